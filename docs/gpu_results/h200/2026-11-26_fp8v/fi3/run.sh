set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fi/*.whl || exit 1
python3 -c "import tarfile; tarfile.open('.fi/flashinfer.tar.xz', 'r:xz').extractall('/tmp/site')" || exit 1
export PYTHONPATH=$PWD:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
mkdir -p $OUT/fi3
timeout 150 python3 -X faulthandler .fi/probe.py flashinfer > $OUT/fi3/probe_auto.log 2>&1; echo "probe auto rc=$?"; grep "ok, rel" $OUT/fi3/probe_auto.log
for pt in cogvideox-2b:190:flashinfer,flashinfer:backend=fa2,fav3 wan2.1-1.3b-480p:210:flashinfer,flashinfer:backend=fa2,fav3 wan2.1-14b-720p:120:flashinfer,fav3; do
  p=${pt%%:*}; r=${pt#*:}; t=${r%%:*}; ks=${r#*:}
  timeout $t python3 bench/bench_attention.py --preset $p --kernel $ks --baseline fav3 -metric all -o $OUT/fi3/fi_$p.csv > $OUT/fi3/fi_$p.log 2>&1; echo "$p rc=$?"; grep -E "flashinfer|fav3 " $OUT/fi3/fi_$p.log | cut -c1-240 | tail -6
done
cd $OUT && tar czf fi3.tgz fi3 && rm -rf fi3
