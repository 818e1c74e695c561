"""The tier of every test module: the pytest markers `unit`, `integration` and `e2e` (registered in
pyproject.toml), given to each test by conftest.py's `pytest_collection_modifyitems`.

    python -m pytest -q -m unit          # one module's code on tiny in-memory inputs, in process
    python -m pytest -q -m integration   # stages together, the commands as subprocesses, 2-process
                                         # engines, faults of files and machine; tiny random targets
    python -m pytest -q -m e2e           # the real SmolLM2 target and ShareGPT, vLLM serving
    python -m pytest -q                  # all three (what CI runs)

tests/test_tiers.py checks that every test module has exactly one tier.
"""

TIERS = {
    "unit": (
        "test_alignment", "test_amx_attention", "test_aux_numbering", "test_bad_input_data", "test_bad_input_fuzz",
        "test_benchmarks", "test_cod", "test_cod_attention", "test_config", "test_data", "test_decoding",
        "test_dflash", "test_dflash_recipe", "test_docs_paths", "test_eagle3", "test_engine", "test_export", "test_extras", "test_head",
        "test_layout", "test_packed_linear", "test_plan", "test_precision", "test_precision_training",
        "test_provenance", "test_recipe_knobs", "test_recommend_k", "test_shared", "test_sources", "test_templates",
        "test_tiers",
        "test_training",
    ),
    "integration": (
        "test_ablation_report", "test_bad_input_cli", "test_bad_input_files", "test_cli", "test_cuda",
        "test_distributed", "test_engines", "test_evaluate", "test_export_cli", "test_gpu_check", "test_gpu_data_plan", "test_gpu_semantics",
        "test_io_faults", "test_logging", "test_loop", "test_multiprocess_faults", "test_offline_features",
        "test_package_data",
        "test_packed_features", "test_parity", "test_preemption", "test_recipes", "test_regen_fair", "test_regenerate", "test_resume",
        "test_run_lock", "test_scale", "test_scaling",
        "test_settings_fuzz", "test_stage_config", "test_target_load", "test_train_embeddings",
    ),
    "e2e": (
        "test_data_real", "test_precision_guard", "test_smoke_real", "test_targets_real", "test_vllm",
    ),
}

TIER_OF = {module: tier for tier, modules in TIERS.items() for module in modules}
