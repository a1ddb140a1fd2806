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
        recovery = float(row["recovery_s"])  # type: ignore[arg-type]
        unrelated = row["unrelated_errors"]
        lines.append(
            f"| {row['scenario']} | {float(row['detection_s']):.3f} s "  # type: ignore[arg-type]
            f"| {'—' if math.isnan(recovery) else f'{recovery:.3f} s'} "
            f"| {'—' if unrelated is None else unrelated} | {row['leaked']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as source:
        print(table(json.load(source)))
