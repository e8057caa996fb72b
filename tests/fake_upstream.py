"""A stand-in 'upstream' module for testing the patch machinery in isolation."""

from __future__ import annotations


def helper(x: int) -> int:
    return x + 1


class Store:
    def put(self, x: int) -> int:
        return x * 2

    def get(self, x: int) -> int:
        return x - 1


class Tools:
    @staticmethod
    def scale(x: int) -> int:
        return x * 3
