"""MLflow lineage: where the store is (``store``), the run tree of one workflow execution and its
lineage (``runs``), datasets and artifacts (``artifacts``), buffered per-step metrics (``metrics``),
heartbeats and the closing of killed executions' runs (``heartbeat``).
Everything is re-exported here: ``from diffusionrl import tracking; tracking.stage_run(...)``."""

from .artifacts import folder_size_mb, frame_digest, image_row, log_folder_or_link, log_prompt_datasets
from .heartbeat import HEARTBEAT_TAG, Heartbeat, beat, fail_stale_runs
from .metrics import MetricLogger, log_metrics_file
from .runs import (
    LINEAGE_KEYS,
    PARENT_TAG,
    STAGE_TAG,
    TrackingRun,
    config_params,
    fail_open_runs,
    finish,
    finish_quietly,
    git_sha,
    lineage,
    lineage_tags,
    log_evaluation,
    log_final_metrics,
    open_stage,
    run_url,
    set_tags,
    stage_run,
    start_workflow_run,
)
from .store import (
    ENV_URI,
    LOCAL_STORE,
    TrackingUnavailable,
    artifact_location,
    client,
    configure_http,
    ensure_experiment,
    local_store_uri,
    preflight,
    resolve_uri,
    with_retries,
)

__all__ = [
    "ENV_URI", "HEARTBEAT_TAG", "LINEAGE_KEYS", "LOCAL_STORE", "PARENT_TAG", "STAGE_TAG", "Heartbeat", "MetricLogger",
    "TrackingRun", "beat", "fail_stale_runs",
    "TrackingUnavailable", "artifact_location", "client", "config_params", "configure_http", "ensure_experiment",
    "fail_open_runs", "finish", "finish_quietly", "folder_size_mb", "frame_digest", "git_sha", "image_row",
    "lineage", "lineage_tags", "local_store_uri", "log_evaluation", "log_final_metrics", "log_folder_or_link",
    "log_metrics_file", "log_prompt_datasets",
    "open_stage", "preflight", "resolve_uri", "run_url", "set_tags", "stage_run", "start_workflow_run",
    "with_retries",
]
