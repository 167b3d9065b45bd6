set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fi/*.whl || exit 1
python3 -c "import tarfile; tarfile.open('.fi/flashinfer.tar.xz', 'r:xz').extractall('/tmp/site')" || exit 1
export PYTHONPATH=$PWD:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
mkdir -p $OUT/fi
which nvcc; nvcc --version | tail -1
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -3
for pt in cogvideox-2b:210 wan2.1-1.3b-480p:210 wan2.1-14b-720p:110; do
  p=${pt%%:*}; t=${pt##*:}
  timeout $t python3 bench/bench_attention.py --preset $p --kernel flashinfer,fav3,sdpa_cudnn --baseline fav3 -metric all -o $OUT/fi/fi_$p.csv > $OUT/fi/fi_$p.log 2>&1; echo "$p rc=$?"; grep -E "flashinfer|fav3 " $OUT/fi/fi_$p.log | cut -c1-260 | tail -4
done
python3 -m pytest -q -p no:cacheprovider tests/test_backends_packaged.py > $OUT/fi/pytest_packaged.txt 2>&1; tail -3 $OUT/fi/pytest_packaged.txt
cd $OUT && tar czf fi.tgz fi && rm -rf fi
