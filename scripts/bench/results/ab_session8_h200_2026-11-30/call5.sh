# Session 8, call 5 (main 8aaf6ea checked out; its kernels are ea60c72's csrc, .s8/main.so):
# the same-run anchor against ExLlamaV3 1.6.5, built in this lease by call 1, all 975 points.
EXL3_COMMIT=8aaf6ea EXT=.s8/main.so CALL_LIMIT_S=585 EXL3_STATE=/tmp/exl3_next bash scripts/bench/next_session.sh call2 > /dev/null 2>&1; ls $OUT; tail -5 $OUT/call2.log
