"""Dependency resolver: a patch stands only when every task it depends on is accepted too.

A task on a dependency cycle (or depending on one) can never be settled: its patch is rejected
``dependency_cycle``. A patch whose dependency has no accepted patch (rejected, declared
unresolved by the agent, or not a task of the request) is rejected ``dependency_unresolved``;
this repeats to a fixpoint, so a chain falls as a whole.
"""

from __future__ import annotations

from fieldrecovery.schemas import RecoveryPatch, RecoveryRequestSet, Rejection


def resolve_dependencies(
    request: RecoveryRequestSet, valid: list[RecoveryPatch]
) -> tuple[list[RecoveryPatch], list[Rejection]]:
    """Split validated patches into (accepted, rejected) by the request's ``depends_on`` graph."""
    graph = {t.task_id: list(t.depends_on) for t in request.tasks}
    cyclic = _on_or_behind_cycle(graph)
    rejected: list[Rejection] = []
    standing: dict[str, RecoveryPatch] = {}
    for patch in valid:
        if patch.task_id in cyclic:
            rejected.append(Rejection(task_id=patch.task_id, reason="dependency_cycle"))
        else:
            standing[patch.task_id] = patch
    changed = True
    while changed:
        changed = False
        for task_id in list(standing):
            if any(dep not in standing for dep in graph.get(task_id, [])):
                del standing[task_id]
                rejected.append(Rejection(task_id=task_id, reason="dependency_unresolved"))
                changed = True
    accepted = [p for p in valid if p.task_id in standing]
    return accepted, rejected


def _on_or_behind_cycle(graph: dict[str, list[str]]) -> set[str]:
    """Tasks from which a dependency cycle is reachable (including the cycle's members)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    bad: set[str] = set()

    def visit(node: str) -> bool:
        if state.get(node) == 1:
            return True
        if state.get(node) == 2:
            return node in bad
        state[node] = 1
        hit = False
        for dep in graph.get(node, []):
            if dep in graph and visit(dep):
                hit = True
        state[node] = 2
        if hit:
            bad.add(node)
        return hit

    for node in graph:
        visit(node)
    return bad
