"""Instructions on the common path of a decode kernel's main loop (issue 17 SASS counts).

Reads ``cuobjdump -sass`` output (``bench/kernels_cuda.py --sass`` writes it to
``$OUT/decode_cuda.sass``; a local ``nvcc -cubin`` of ``kernels/cuda/csrc/decode.cu`` with the
extension's flags gives the same machine code), picks the function whose mangled name
contains ``FUNC`` and walks its first loop holding HMMA from the loop head to the backward
branch. Unpredicated branches are followed; a predicated branch is taken when it skips a
lazy-rescale block (its predicate comes from VOTE) or a 32-page block-table refill (an
``ISETP ... 0x20`` compare), or when its address is listed in ``--take`` (the branches to the
both-tiles copy block and to the unmasked pair step, read off ``--list``); every other branch
falls through. Prints the opcode counts of that path: per 32 tokens for the pair loops.

    python3 bench/sass_path.py decode_cuda.sass Li4ELi2ELi4ELi0ELi1ELi0E --list
    python3 bench/sass_path.py decode_cuda.sass Li4ELi2ELi4ELi0ELi1ELi0E --take 0x3480,0x4440
"""

from __future__ import annotations

import argparse
import re
from collections import Counter


def parse(text: str, func: str) -> list[tuple[int, str | None, str]]:
    """(address, predicate or None, instruction text) of the first function matching ``func``."""
    fn = next(f for f in re.split(r"\n\s*Function : ", text)[1:] if func in f.split("\n", 1)[0])
    out = []
    for addr, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", fn):
        pred = re.match(r"^@(!?U?P\w+)\s+", t)
        out.append((int(addr, 16), pred.group(1) if pred else None,
                    re.sub(r"^@!?U?P\w+\s+", "", t)))
    return out


def target(body: str) -> int:
    return int(re.search(r"0x([0-9a-f]+)", body).group(1), 16)


def walk(ins: list, take: set[int], show: bool = False) -> Counter:
    idx = {a: i for i, (a, _, _) in enumerate(ins)}
    loops = [(target(b), a) for a, p, b in ins
             if b.startswith("BRA") and not b.startswith("BRA.DIV") and target(b) < a]
    lo, hi = next((lo, hi) for lo, hi in loops
                  if any(b.startswith("HMMA") for a, _, b in ins if lo <= a <= hi))
    i, cnt, setter = idx[lo], Counter(), {}
    for _ in range(20000):
        a, p, b = ins[i]
        op = b.split()[0]
        cnt[op.split(".")[0]] += 1
        m = re.match(r"ISETP\.\w+\.AND (P\d), PT, R\d+, 0x20", b)
        if m:
            setter[m.group(1)] = "refill"
        if op.startswith("VOTE"):
            setter[b.split()[1].rstrip(",")] = "vote"
        if a == hi:
            break
        if op == "BRA":
            if show:
                print(f"branch {a:#x}: {'@' + p if p else ''} {b}")
            if p is None or setter.get(p.lstrip("!")) in ("vote", "refill") or a in take:
                i = idx[target(b)]
                continue
        i += 1
    return cnt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sass")
    ap.add_argument("func", help="substring of the mangled kernel name")
    ap.add_argument("--take", default="", help="branch addresses to take, comma separated")
    ap.add_argument("--list", action="store_true", help="print the branches met on the way")
    a = ap.parse_args()
    take = {int(x, 16) for x in a.take.split(",") if x}
    cnt = walk(parse(open(a.sass).read(), a.func), take, a.list)
    print(sum(cnt.values()), dict(cnt.most_common(24)))


if __name__ == "__main__":
    main()
