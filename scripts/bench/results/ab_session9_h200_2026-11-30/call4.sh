# Session 9, call 4: the same-run ExLlamaV3 1.6.5 anchor (ExLlamaV3 built in call 3, same lease)
# on main's kernels (591068b; kernels = 3ce21a4's csrc + 6fcbe7e's host check): the issue's five
# shapes, bits 4 6 2 3 5, all codebooks, m 1..4096, ours tuned, bf16 torch.matmul.
set -u
export PYTHONUNBUFFERED=1
EXL3_COMMIT=591068b EXT=.s9/main.so CALL_LIMIT_S=585 EXL3_STATE=/tmp/exl3_next \
  OUT=$OUT bash scripts/bench/next_session.sh call2
