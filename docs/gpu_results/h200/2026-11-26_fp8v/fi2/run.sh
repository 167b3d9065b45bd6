set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fi/*.whl || exit 1
python3 -c "import tarfile; tarfile.open('.fi/flashinfer.tar.xz', 'r:xz').extractall('/tmp/site')" || exit 1
export PYTHONPATH=$PWD:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
mkdir -p $OUT/fi2
for m in nhd_fa3 nhd_fa2 flashinfer:backend=fa2 flashinfer; do
  timeout 150 python3 -X faulthandler .fi/probe.py $m > $OUT/fi2/probe_$m.log 2>&1; rc=$?; echo "$m rc=$rc"; grep -v "^  File\|^    " $OUT/fi2/probe_$m.log | grep -v "INFO" | tail -4 | cut -c1-200
  [ $m = nhd_fa2 ] && fa2rc=$rc
done
if [ "${fa2rc:-1}" = 0 ]; then
  for p in cogvideox-2b wan2.1-1.3b-480p; do
    timeout 170 python3 bench/bench_attention.py --preset $p --kernel flashinfer:backend=fa2,fav3 --baseline fav3 -metric all -o $OUT/fi2/fi_$p.csv > $OUT/fi2/fi_$p.log 2>&1; echo "$p rc=$?"; grep -E "flashinfer|fav3 " $OUT/fi2/fi_$p.log | cut -c1-240 | tail -4
  done
fi
cd $OUT && tar czf fi2.tgz fi2 && rm -rf fi2
