"""Optional hardware plug-ins, hooked in from outside: nothing in the core imports them.

cpu/: the Intel AMX kernels for bf16 decoding on CPU (packed linears, RMSNorm and attention),
installed on a model by `peagle_train.accel.cpu.accelerate_for_decoding`.
"""
