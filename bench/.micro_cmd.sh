python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/fa3*.whl || exit 1; export PYTHONPATH=$PWD:/tmp/site
TR="timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node=2 bench/ulysses_micro.py"
$TR --only exchange,ce,layer --margins '' -o $OUT/m_default.json 2>&1 | grep -E '^[a-z_0-9]+ ' 
for e in "NCCL_MIN_P2P_NCHANNELS=32" "NCCL_P2P_NVL_CHUNKSIZE=2097152" "NCCL_MIN_P2P_NCHANNELS=32 NCCL_P2P_NVL_CHUNKSIZE=2097152" "NCCL_MIN_NCHANNELS=32 NCCL_MIN_P2P_NCHANNELS=32" "NCCL_PROTO=Simple"; do
  n=$(echo $e | tr ' =' '__'); echo "== $e"; env $e $TR --only exchange,layer --margins '' -o $OUT/m_$n.json 2>&1 | grep -E '^[a-z_0-9]+ '
done
