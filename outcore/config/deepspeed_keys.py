"""The keys DeepSpeed (0.19) knows in the sections outcore reads, aliases included.

DeepSpeed refuses a key it does not know in these sections; outcore refuses one that is a
letter or two from one of them as a typo (deepspeed.py's ``_check_spelling``), and lists the
others it has no use for. Kept apart from the translation: a list to update with DeepSpeed,
not logic.
"""

from __future__ import annotations

ZERO_KEYS = frozenset((
    "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm",
    "contiguous_gradients", "cpu_offload", "cpu_offload_param", "cpu_offload_params",
    "cpu_offload_use_pin_memory", "elastic_checkpoint", "enable_sanity_checks",
    "gather_16bit_weights_on_model_save", "ignore_unused_parameters", "leaf_module",
    "legacy_stage1", "load_from_fp32_weights", "log_trace_cache_warnings", "max_live_parameters",
    "max_reuse_distance", "memory_efficient_linear", "model_persistence_threshold",
    "module_granularity_threshold", "offload_optimizer", "offload_param", "overlap_comm",
    "override_module_apply", "param_persistence_threshold", "parameter_alignment",
    "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size", "reduce_scatter",
    "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage",
    "stage3_allgather_sequential", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_param_persistence_threshold",
    "stage3_prefetch_bucket_size", "stage3_use_all_reduce_for_fetch_params", "sub_group_size",
    "use_all_reduce_for_fetch_params", "use_multi_rank_bucket_allreduce", "zenflow",
    "zero_hpz_partition_size", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
    "zero_quantized_weights"
))
FP16_KEYS = frozenset((
    "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
    "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"))
OPTIMIZER_KEYS = frozenset((  # Adam's, AdamW's and SGD's params in DeepSpeed's files
    "lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad", "bias_correction",
    "torch_adam", "fp32_optimizer_states", "momentum", "dampening", "nesterov"))
OFFLOAD_KEYS = frozenset((
    "buffer_count", "buffer_size", "device", "max_in_cpu", "nvme_path", "pin_memory",
    "cpuadam_cores_perc", "fast_init", "pipeline_read", "pipeline_write", "ratio", "super_offload"
))
