"""The mutation score of a `make mutate` run, per module, and its surviving mutants.

Reads mutmut's result files (``mutants/**/*.py.meta``). The score is killed / (killed +
survived + no tests): a mutant no test reaches counts as surviving. Timeouts count as
killed (the mutant made a test hang: a test noticed), as mutmut does.

Usage: python scripts/mutation_score.py [MUTANTS_DIR]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code  # the tool's own exit-code meanings


def main(root: str = "mutants") -> int:
    metas = sorted(Path(root).rglob("*.py.meta"))
    if not metas:
        print(f"no mutmut results under {root}/: run `make mutate` first", file=sys.stderr)
        return 2
    total: Counter[str] = Counter()
    survivors: list[str] = []
    print(f"{'module':40} {'mutants':>8} {'killed':>7} {'survived':>9} {'no tests':>9} {'score':>7}")
    for meta in metas:
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        c: Counter[str] = Counter()
        for name, code in sorted(codes.items()):
            status = status_by_exit_code[code]
            status = "killed" if status == "timeout" else status
            c[status] += 1
            if status in ("survived", "no tests"):
                survivors.append(f"{status:9} {name}")
        total += c
        module = str(meta.relative_to(root))[: -len(".meta")]
        print(f"{module:40} {sum(c.values()):8} {c['killed']:7} {c['survived']:9} {c['no tests']:9} {score(c):>7}")
    print(f"{'all':40} {sum(total.values()):8} {total['killed']:7} {total['survived']:9} "
          f"{total['no tests']:9} {score(total):>7}")
    other = {k: v for k, v in total.items() if k not in ("killed", "survived", "no tests")}
    if other:
        print("other results:", dict(other))
    print(f"\n{len(survivors)} surviving mutants (`mutmut show NAME` prints one):")
    print("\n".join(survivors))
    return 0


def score(c: Counter[str]) -> str:
    judged = c["killed"] + c["survived"] + c["no tests"]
    return f"{100 * c['killed'] / judged:.1f}%" if judged else "-"


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
