"""A stand-in 'upstream' module that tests import only after prime_r3.apply()."""

from __future__ import annotations


class Worker:
    def warm_up(self) -> str:
        return "warm"


def step(x: int) -> int:
    return x + 1


class Tools:
    @staticmethod
    def scale(x: int) -> int:
        return x * 3
