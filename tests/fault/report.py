"""Print the fault scenarios' table from the JSON the fault tests wrote
($FAULT_REPORT_JSON); run by scripts/fault_report.sh."""

from __future__ import annotations

import json
import math
import sys


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| scenario | detection | recovery | errors in the unrelated world | leaked |",
             "|---|---|---|---|---|"]
    for row in rows:
        unrelated = row["unrelated_errors"]
        lines.append(
            f"| {row['scenario']} | {seconds(row['detection_s'])} | {seconds(row['recovery_s'])} "
            f"| {'—' if unrelated is None else unrelated} | {row['leaked']} |")
    return "\n".join(lines)


def seconds(value: object) -> str:
    """NaN: the scenario has no such moment (a refusal is immediate; nothing to rebuild)."""
    number = float(value)  # type: ignore[arg-type]
    return "—" if math.isnan(number) else f"{number:.3f} s"


if __name__ == "__main__":
    with open(sys.argv[1]) as source:
        print(table(json.load(source)))
