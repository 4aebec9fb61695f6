"""The compute device and the machine around it.

``accel`` is the one seam between outcore and CPU or CUDA (streams, page-locked buffers, the
collective backend); ``compute_dtype`` resolves ``dtype: auto`` to what the device multiplies
natively; ``machine`` names the CPU and GPU so every measurement carries its machine.
"""
