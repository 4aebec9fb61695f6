import sys

from outcore.sizing.probe import measure

r = measure(sys.argv[1], disk_seconds=8.0, matmul_seconds=1.0)
print(
    f"PROBE read {r.disk_read_GBps:.2f} write {r.disk_write_GBps:.2f} GB/s "
    f"bf16 {r.matmul_bf16_TFLOPs:.2f} TFLOP/s"
)
