"""A trace-driven simulator: replays decoders' scheduling with a step-cost model instead of a model.

acceptance: what each verification accepts (a stored run's outcomes, or a parametric model).
costs: what a step costs (this machine's calibration, or a roofline of a hardware profile and a
model shape). policies: each decoder's scheduling decision. replay: the simulated run. source:
simulations of stored runs and parametric settings, as run records of kind "simulated".
"""
