"""The first import circle in a graph of modules (or files): the layering test's and the
whole-tree circle test's one search, so both read a circle the same way."""

from __future__ import annotations


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle as the path that closes it (its first node again at the end), or None. Nodes
    and edges are visited in sorted order, so the same graph always names the same circle."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := dfs(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := dfs(n)):
            return found
    return None
