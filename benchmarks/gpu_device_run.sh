#!/usr/bin/env bash
# On a GPU machine without TVM's compiler: install TVM's runtime from PACK (made here by
# `gpu_device_check.py pack PACK` and `build PACK/bundle`), then run the check into OUT.
#   bash benchmarks/gpu_device_run.sh PACK OUT      (ONLY=_check_kernels,... picks steps;
#                                                   NCU="kernel ..." profiles kernels with ncu)
set -u
PACK=${1:?PACK directory}
OUT=${2:?output directory}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$PACK"/apache_tvm_ffi-*.whl || exit 3
tar -C /tmp/site -xJf "$PACK"/tvm_runtime.tar.xz || exit 3
CUDART=$(ls /usr/local/cuda/lib64/libcudart.so.13* /usr/local/cuda/targets/x86_64-linux/lib/libcudart.so.13* \
  /opt/torch/.venv/lib/python3.12/site-packages/nvidia/*/lib/libcudart.so.13* 2>/dev/null | head -1)
[ -z "$CUDART" ] && CUDART=$(find /usr /opt -name 'libcudart.so.13*' 2>/dev/null | head -1)
echo "libcudart: $CUDART"
export LD_LIBRARY_PATH=$(dirname "$CUDART"):${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/site:$PWD TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
python3 -c "import tvm, torch; print('tvm', tvm.__version__, tvm.__file__, 'torch', torch.__version__)"
python3 benchmarks/gpu_device_check.py run "$PACK"/bundle "$OUT" --rounds "${ROUNDS:-20}" --only "${ONLY:-}" 2>&1 | tee "$OUT/log.txt"
if [ -n "${NCU:-}" ]; then
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  echo "ncu: $NCU_BIN"
  "$NCU_BIN" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis -k regex:"($(echo $NCU | tr " " "|"))_kernel" -c "$(echo $NCU | wc -w)" \
    python3 benchmarks/gpu_device_check.py profile "$PACK"/bundle $NCU > "$OUT/ncu.txt" 2>&1
  grep -E "profiled|==PROF==|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Size|Grid Size|Warp Cycles Per Issued|Stall|L1/TEX Hit|Mem Busy|Issue Slots Busy|Compute \(SM\) Throughput|One or More Eligible" "$OUT/ncu.txt" | head -120
fi
