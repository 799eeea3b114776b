"""How the pytest plugin turns what each rank saw into one report: a test phase's outcomes,
a pytest.exit on some ranks, a collection that differs between ranks.

The rules for outcomes, the same on every rank: a failure on any rank fails the phase; otherwise
an expected failure (xfail) on any rank makes it xfailed; skipped on every rank, it is skipped;
skipped on some ranks only, it counts as passed, with a note saying where it was skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class _Crash:
    message: str

    def __str__(self) -> str:  # --tb=line prints str(reprcrash)
        return self.message


class CombinedFailure:
    """The failure report of a phase that failed on some ranks: every failing rank's report,
    tagged. Its first line is the crash message, which is all the short test summary shows (a
    plain string would be shown whole there on CI, where pytest does not trim it)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.reprcrash = _Crash(text.split("\n", 1)[0])

    def toterminal(self, tw: object) -> None:
        for line in self.text.splitlines():
            tw.line(line)  # type: ignore[attr-defined]

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class PhaseOutcome:
    """One rank's outcome of one phase (setup, call, teardown) of one test, as exchanged."""

    nodeid: str
    when: str
    outcome: str  # "passed", "failed" or "skipped", as pytest reported it on this rank
    wasxfail: str | None  # pytest's report.wasxfail: an xfail that failed as expected, or passed
    text: str | None  # the failure report with its captured output (failures only)
    reason: str | None  # the skip reason (skips only)
    secondary: bool  # failed only because it gave up waiting for a rank that failed
    alerted: bool  # this rank posted a failure alert during this phase
    # (what, reason, returncode): pytest.exit(reason, returncode) called on this rank, what
    # being "called pytest.exit", or a KeyboardInterrupt, "was interrupted"
    exit: tuple[str, str, int | None] | None
    # mpaccel's own communicator on this rank was left unusable (a collective abandoned): every
    # rank then resynchronises it before the next phase
    broken: bool = False

    @classmethod
    def of(
        cls,
        report: pytest.TestReport,
        secondary: bool,
        alerted: bool,
        exit: tuple[str, str, int | None] | None,
        broken: bool = False,
    ) -> PhaseOutcome:
        reason = None
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        return cls(
            report.nodeid,
            str(report.when),
            report.outcome,
            getattr(report, "wasxfail", None),
            report_text(report) if report.failed else None,
            reason,
            secondary,
            alerted,
            exit,
            broken,
        )

    @property
    def xfailed(self) -> bool:
        return self.outcome == "skipped" and self.wasxfail is not None


def report_text(report: pytest.TestReport) -> str:
    text = str(report.longrepr) if report.longrepr is not None else ""
    for title, content in report.sections:
        text += f"\n----- {title} -----\n{content}"
    return text


def _reasons(outcomes: Sequence[PhaseOutcome], ranks: Sequence[int]) -> str:
    reasons = {r: outcomes[r].reason or outcomes[r].wasxfail or "no reason given" for r in ranks}
    if len(set(reasons.values())) == 1:
        return next(iter(reasons.values()))
    return "; ".join(f"rank {r}: {reason}" for r, reason in reasons.items())


def combine(report: pytest.TestReport, outcomes: Sequence[PhaseOutcome], rank: int) -> str | None:
    """Make `report` (this rank's) the combined outcome of `outcomes` (every rank's, in rank
    order). Returns a note when the ranks did not agree and the report alone would not say so."""
    size = len(outcomes)
    when = report.when
    failed = [r for r, o in enumerate(outcomes) if o.outcome == "failed"]
    xfailed = [r for r, o in enumerate(outcomes) if o.xfailed]
    skipped = [r for r, o in enumerate(outcomes) if o.outcome == "skipped" and not o.xfailed]
    note = None
    if skipped and len(skipped) < size:
        note = f"skipped on rank(s) {skipped} of {size} ({_reasons(outcomes, skipped)})"
    if failed:
        primary = [r for r in failed if not outcomes[r].secondary]
        waiting = [r for r in failed if r not in primary]
        if primary:
            head = f"{when} failed on rank(s) {primary} of {size}"
            if waiting:
                head += f"; rank(s) {waiting} gave up waiting for them in a collective"
        elif skipped or xfailed:
            head = (
                f"{when} failed on rank(s) {waiting} of {size}: they gave up waiting in a "
                f"collective for rank(s) {sorted(skipped + xfailed)}, which skipped "
                f"{'(or xfailed) ' if xfailed else ''}this test"
            )
        else:
            head = f"{when} failed on rank(s) {waiting} of {size} (each gave up waiting)"
        parts = [head]
        shown = primary or waiting
        for r in shown:
            parts.append(f"{'=' * 20} rank {r} {'=' * 20}")
            parts.extend(f"[rank {r}] {line}" for line in (outcomes[r].text or "").splitlines())
        report.outcome = "failed"
        report.longrepr = CombinedFailure("\n".join(parts))  # type: ignore[assignment]
        # This rank's captured output: in the text above if it is shown there, else printed
        # after it, where it must not pass for the failing rank's.
        report.sections = [
            (title if not title.startswith("Captured ") else f"{title} (rank {rank})", content)
            for title, content in report.sections
            if not (rank in shown and title.startswith("Captured "))
        ]
        if hasattr(report, "wasxfail"):
            del report.wasxfail
        if note:
            report.sections.append(("mpaccel", note))
        return None  # the failure report says it all
    if xfailed:
        first = outcomes[xfailed[0]]
        report.outcome = "skipped"
        if len(xfailed) == size:
            return None
        report.wasxfail = f"{first.wasxfail} [xfailed on rank(s) {xfailed} of {size} only]"
        if not outcomes[rank].xfailed:
            report.longrepr = None
        note = f"xfailed on rank(s) {xfailed} of {size} ({_reasons(outcomes, xfailed)})" + (
            f", {note}" if note else ""
        )
        report.sections.append(("mpaccel", note))
        return f"{note}; counted as xfailed"
    if len(skipped) == size:
        report.outcome = "skipped"
        return None
    if note is None:
        return None
    if outcomes[rank].outcome == "skipped":
        report.outcome = "passed"
        report.longrepr = None
    report.sections.append(("mpaccel", note))
    return f"{note}; counted as passed"


def exit_everywhere(
    report: pytest.TestReport, exits: Mapping[int, tuple[str, str, int | None]]
) -> BaseException:
    """The Exit every rank raises when some ranks called pytest.exit (or were interrupted): it
    names them, their reasons, and carries the exit code of the lowest of them that gave one."""
    ranks = sorted(exits)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    whats = {exits[r][0] for r in ranks}
    what = whats.pop() if len(whats) == 1 else "called pytest.exit or were interrupted"
    if len(ranks) > 1:
        what = what.replace("was interrupted", "were interrupted")
    reasons = {exits[r][1] for r in ranks}
    if len(reasons) == 1:
        detail = reasons.pop()
    else:
        detail = "; ".join(f"rank {r}: {exits[r][1]}" for r in ranks)
    reason = f"{who} {what} during {report.nodeid} ({report.when}): {detail}"
    codes = [exits[r][2] for r in ranks if exits[r][2] is not None]
    return pytest.exit.Exception(reason, codes[0] if codes else None)


def collection_mismatch(gathered: Sequence[tuple[list[str], dict[str, str]]]) -> str:
    """The usage error rank 0 prints when collection differs between ranks. `gathered[r]` is
    rank r's (collected node ids, {node id: collection error})."""
    reference = gathered[0][0]
    same = all(ids == reference for ids, _ in gathered)
    lines = [
        "ranks had different collection errors:" if same else "ranks collected different tests:"
    ]
    for r, (other, _) in enumerate(gathered[1:], start=1):
        if other != reference:
            missing = sorted(set(reference) - set(other))[:5]
            extra = sorted(set(other) - set(reference))[:5]
            lines.append(
                f"  rank {r}: {len(other)} tests vs rank 0's {len(reference)}; "
                f"missing {missing or 'none'}, extra {extra or 'none'}"
                + ("" if missing or extra else ", same tests in another order")
            )
    # Collection errors some ranks had and others did not: the usual cause, shown once each.
    where: dict[tuple[str, str], list[int]] = {}
    for r, (_, errors) in enumerate(gathered):
        for nodeid, text in errors.items():
            where.setdefault((nodeid, text), []).append(r)
    partial = {key: ranks for key, ranks in where.items() if len(ranks) < len(gathered)}
    for (nodeid, text), ranks in partial.items():
        lines.append(f"collection error in {nodeid} on rank(s) {ranks} only:")
        lines.extend(f"[rank {ranks[0]}] {line}" for line in text.splitlines())
    if partial:
        hint = (
            "some ranks could not collect a test module that the others collected: fix the "
            "error above (e.g. a package missing or failing to import on some nodes or ranks)."
        )
    else:
        hint = (
            "collection must not depend on the rank (rank-dependent skipif at import, random "
            "parametrisation, files created during collection); use @pytest.mark.mpi(...) to "
            "restrict world sizes."
        )
    return "\n".join([*lines, f"HINT: {hint}"])
