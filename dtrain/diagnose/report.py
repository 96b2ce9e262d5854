"""What diagnosis answers: sections of a few lines each, and the findings (what is wrong, with
the flags that address it) that the text names and `--json` lists."""

from __future__ import annotations

import attrs

MAX_LINES = 40
SUMMARY_STEPS = 4  # steps named per kind of finding in the last line


@attrs.frozen
class Finding:
    """Something wrong with the run: `kind` names it for programs (`slow_data`, `nan`, ...),
    `text` for people, `flags` the change that addresses it where one does."""

    section: str
    kind: str
    text: str
    step: int | None = None
    flags: str = ""

    def as_json(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class Section:
    """One part of the report: its title, its lines (findings among them), its findings, and the
    figures behind them for --json."""

    name: str
    title: str
    lines: list[str]
    findings: list[Finding] = attrs.field(factory=list)
    figures: dict = attrs.field(factory=dict)


@attrs.frozen
class Diagnosis:
    header: str
    sections: list[Section]

    @property
    def findings(self) -> list[Finding]:
        return [f for section in self.sections for f in section.findings]

    def text(self) -> str:
        lines = [self.header]
        for section in self.sections:
            lines += [f"{section.title}:", *(f"  {line}" for line in section.lines)]
        lines.append(self.summary())
        assert len(lines) <= MAX_LINES, f"{len(lines)} lines"
        return "\n".join(lines)

    def summary(self) -> str:
        """The last line: each kind of finding and its steps (`nan at steps 4, 9`), or that there is none."""
        findings = self.findings
        if not findings:
            return "nothing wrong found"
        steps: dict[str, list[int]] = {}
        for finding in findings:
            steps.setdefault(finding.kind, []).extend([] if finding.step is None else [finding.step])
        parts = []
        for kind, at in steps.items():
            shown = ", ".join(map(str, at[:SUMMARY_STEPS])) + (", ..." if len(at) > SUMMARY_STEPS else "")
            parts.append(kind + (f" at step{'s' if len(at) > 1 else ''} {shown}" if at else ""))
        return f"{len(findings)} finding{'s' if len(findings) != 1 else ''}: {'; '.join(parts)}"

    def as_json(self) -> dict:
        return {"header": self.header, "findings": [f.as_json() for f in self.findings],
                **{s.name: {"lines": s.lines, **s.figures} for s in self.sections}}


def share(part: float, whole: float) -> str:
    """`12%` of a whole (`-` where the whole is nothing)."""
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def cap(lines: list[str], most: int, what: str) -> list[str]:
    """At most `most` lines, the last saying how many more of `what` were left out."""
    if len(lines) <= most:
        return lines
    return lines[:most - 1] + [f"... and {len(lines) - most + 1} more {what}"]
