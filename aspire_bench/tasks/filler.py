"""Deterministic filler prose for synthetic tasks: plain sentences from small invented word lists,
varied enough that the haystack is not one repeated line, meaningless enough to hold no answers."""
from __future__ import annotations

import random
from collections.abc import Iterator

_SUBJECTS = ("The old ferryman", "A quiet engineer", "The village baker", "Our new neighbour",
             "The tired cartographer", "A patient gardener", "The night porter", "A travelling musician",
             "The school librarian", "An elderly beekeeper", "The harbour pilot", "A curious child")
_VERBS = ("carefully repaired", "slowly painted", "happily described", "briefly visited",
          "once measured", "quietly rearranged", "proudly photographed", "often cleaned",
          "never forgot", "suddenly noticed", "politely returned", "eagerly sketched")
_OBJECTS = ("the wooden bridge", "a blue umbrella", "the brass telescope", "an empty lantern",
            "the stone wall", "a broken compass", "the tall clock", "a basket of pears",
            "the narrow staircase", "a folded map", "the copper kettle", "a pair of boots")
_PLACES = ("near the river", "before the first snow", "behind the market", "after a long walk",
           "on a windy afternoon", "at the edge of town", "during the summer fair", "under the old oak",
           "beside the station", "in the early morning")

ADJECTIVES = ("amber", "brisk", "cobalt", "dusty", "eager", "frosty", "golden", "hollow", "ivory",
              "jolly", "keen", "lunar", "misty", "noble", "olive", "proud", "quiet", "rusty", "silver",
              "tawny", "upper", "velvet", "windy", "young", "zesty")
NOUNS = ("badger", "canyon", "dolphin", "falcon", "glacier", "harbor", "island", "jaguar", "kettle",
         "lantern", "meadow", "nectar", "orchid", "pebble", "quartz", "raven", "saddle", "thistle",
         "tulip", "violin", "walrus", "willow", "yarrow", "zephyr")


def sentences(rng: random.Random) -> Iterator[str]:
    """An endless stream of " Sentence." units (leading space: they join into running text)."""
    while True:
        yield (f" {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
               f"{rng.choice(_PLACES)}.")


def distinct_keys(rng: random.Random, n: int) -> list[str]:
    """n different "adjective-noun" names."""
    pool = [f"{a}-{b}" for a in ADJECTIVES for b in NOUNS]
    return rng.sample(pool, n)
