"""Where our kernels have been measured beating the vendor path, by op and GPU generation.

`auto` picks one of our kernels over the vendor path (cuDNN attention; XLA's FP8 dot and
scaled matmul, i.e. cuBLASLt / cuDNN) only where a benchmark recorded in docs/ showed it
faster on that GPU (`python -m launch.gpu_check`, sections attention and fp8, recorded
in docs/performance.md). A kernel that has never run on a GPU has not earned the default: until
then it stays one `impl=` away, with its tests. Add an entry here with the numbers' docs
reference when a run shows a win; remove it when a later run does not.
"""

from __future__ import annotations

WHERE = "docs/performance.md"

# (op: 'attention' | 'fp8_tensorwise' | 'mxfp8', compute capability major) -> our impl that
# won there; a comment names the run that showed it.
WINS: dict[tuple[str, int], str] = {}


def ours_won(op: str, cc: tuple[int, int], impl: str) -> bool:
    return WINS.get((op, cc[0])) == impl
