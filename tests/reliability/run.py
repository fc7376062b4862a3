"""`make reliability`: every row at its full size against a node process each, then the table;
exit 1 unless every row is clean (0 lost, 0 duplicated, 0 crashes, 0 wrong answers, memory
back to its baseline). A few minutes on 2 cores."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]

import scenarios  # noqa: E402
from harness import Row, table  # noqa: E402


def main() -> int:
    rows = []
    for scenario, size, _ in scenarios.ROWS:
        print(f"running {scenario.__name__} {size} ...", file=sys.stderr, flush=True)
        try:
            rows.append(scenario(**size))
        except Exception as e:  # noqa: BLE001 - a row that could not run is a failed row
            rows.append(Row(scenario.__name__, str(size), 0, wrong=1, notes=[f"{type(e).__name__}: {e}"]))
    print(table(rows))
    return 0 if all(r.clean() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
