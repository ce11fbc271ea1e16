# The helpers session 28's call scripts share (sourced; they set O, F and BUDGET).
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-200} - $(date +%s) )) -ge $1 ]; }
# The KV forward alone per variant, one process each: ab CASES TIMEOUT. AB_VARIANTS (default
# below, as session 29 ran it) and AB_REPS (default 5) may be set; `broken` (session 30) is the
# earlier build run paired.
ab() {
  for v in ${AB_VARIANTS:-pairedkv paired unpaired prev}; do
    case $v in
      pairedkv) B=$F/bench_forward; E=kv;;
      paired) B=$F/bench_forward; E=1;;
      unpaired) B=$F/bench_forward; E=0;;
      prev) B=$F/bench_forward_prev; E=0;;
      broken) B=$F/bench_forward_prev; E=1;;
    esac
    [ -x "$B" ] || continue  # the bundle may hold no earlier build
    echo "== $v $1" >> $O/ab.txt
    BENCH_KV_PAIRED=$E BENCH_KV_ONLY=1 timeout $2 $B /tmp/msa_in $1 ${AB_REPS:-5} >> $O/ab.txt 2>&1
    echo "rc $?" >> $O/ab.txt
  done
  s ab $1
}
show() {
  grep -E "^== |^\| [dp]|^rc|rror|panic" $O/ab.txt | cut -c1-100
  grep -o "msa_forward_kv_f16p\?_sm90 [0-9.]*\|fwd_kv_combine_f16p\? [0-9.]*\|fwd_kv_homes [0-9.]*\|fwd_kv_pair_kv [0-9.]*" $O/ab.txt | paste -sd' ' | fold -w 200
}
# A GPU test binary of the bundle: test_bin NAME TIMEOUT.
test_bin() {
  (REQUIRE_GPU=1 timeout $2 $F/$1 --test-threads=1 > /tmp/test_$1.txt 2>&1; echo "rc $?" >> /tmp/test_$1.txt)
  echo "== $1" >> $O/tests.txt; cat /tmp/test_$1.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$1.txt | head -5
  s test $1
}
