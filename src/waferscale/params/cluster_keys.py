"""The runconfig keys of a Wafer-Scale Cluster job that only set up the cluster (read by `schema.RunConfig` and,
as `csx.debug.*` flags of the trainer layout's callbacks, by `trainer_layout`)."""


# Keys of a Wafer-Scale Cluster job that set up the cluster's own servers, containers and job queue, not what the
# run computes (Model Zoo's RunConfig documents each). A run here has no such servers: each is accepted, unused,
# and listed at the start of the run with its reason.
CLUSTER_KEYS: dict[str, str] = {
    **dict.fromkeys(("compile_crd_memory_gi", "execute_crd_memory_gi", "wrk_memory_gi", "act_memory_gi",
                     "cmd_memory_gi", "wgt_memory_gi", "chf_memory_gi"),
                    "memory limit of one of the cluster's server containers; none runs here"),
    **dict.fromkeys(("python_paths", "mount_dirs"), "paths made visible inside the cluster's containers; a run "
                                                    "here reads the host's files directly"),
    **dict.fromkeys(("credentials_path", "mgmt_address", "mgmt_namespace"),
                    "how a client reaches the cluster's management server; there is none here"),
    **dict.fromkeys(("job_labels", "job_priority", "job_time_sec"),
                    "labels, priority and time limit in the cluster's job queue; there is no queue here"),
    **dict.fromkeys(("num_workers_per_csx", "num_act_servers", "max_act_per_csx", "max_wgt_servers",
                     "transfer_processes"),
                    "how many of the cluster's input-worker, activation-server, weight-server and weight-transfer "
                    "processes to use; one MemoryX process serves a run here"),
    "disable_version_check": "compares the client's release with the cluster's; there is no cluster here",
    "compile_dir": "the cluster's compile artifact directory (--compile_only writes to model_dir)",
    **dict.fromkeys(("debug_args", "debug_args_path", "ini"), "internal flags of the cluster's compiler and "
                                                              "runtime"),
    "wsc_log_level": "log level of the cluster's servers",
}

__all__ = ["CLUSTER_KEYS"]
