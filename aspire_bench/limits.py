"""Upper bounds on sizes a user sets, checked where each is declared (options, sweep files, the API).

Past them a run would exhaust memory building requests or slots long before doing useful work, or
a value would overflow the C types it reaches; the refusal names the bound.
"""
MAX_REQUESTS = 100_000  # --limit, a sweep's limit, simulate --requests
MAX_BATCH = 16_384  # --batch-size, --batch-sizes, simulate --batch
MAX_THREADS = 4_096  # --threads, $ASPIRE_BENCH_THREADS
C_INT_MAX = 2**31 - 1  # integer decoder settings reach the kernels as C ints
