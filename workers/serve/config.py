"""`ServeConfig`: everything one worker process runs with, resolved once and frozen.

`deepseek-pd serve` builds it from its flags (`deepseek_pd.workers.serve.resolution`): the model
directory and what GetModelInfo reports, the runner config with every "auto" decided (device,
dtype, backends, CUDA graphs, KV pool sizing), the engine's worker config, the identity that
GetServerInfo/GetLoads report (its `page_size` is the runner's, so the router's token counts match
the pool), and the gRPC server's address. Builders and the server read it; nobody changes it, and
no value is read back from a running engine.

Example (`serve decode --model tiny --page-size 4`): `config.runner.page_size == 4 ==
config.identity.page_size`, `config.runner.device == "cpu"`, `config.runner.cuda_graph is False`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepseek_pd.workers.group.layout import GroupLayout
from deepseek_pd.workers.metrics.worker_metrics import MetricLabels
from deepseek_pd.workers.metrics.server import MetricsConfig
from deepseek_pd.workers.api.served_model import ServedModelInfo
from deepseek_pd.workers.api.server import ServerConfig
from deepseek_pd.workers.api.servicer import WorkerIdentity
from deepseek_pd.workers.transport.worker_config import WorkerConfig

if TYPE_CHECKING:  # the model code imports torch; this module stays importable without it
    from deepseek_pd.model.runner_config import RunnerConfig


@dataclass(frozen=True)
class ServeConfig:
    runner: "RunnerConfig"
    worker: WorkerConfig
    identity: WorkerIdentity
    model: ServedModelInfo
    server: ServerConfig
    group: GroupLayout = GroupLayout()  # the ranks this worker spans (one process by default)
    metrics: MetricsConfig = MetricsConfig()  # the Prometheus exporter (`--metrics-port`; off by default)

    def __post_init__(self) -> None:
        if self.identity.page_size != self.runner.page_size:
            raise ValueError(f"identity page_size {self.identity.page_size} != runner page_size "
                             f"{self.runner.page_size}: GetLoads would misreport tokens")

    @property
    def role(self) -> str:
        return self.identity.role

    def metric_labels(self, rank: int = 0) -> MetricLabels:
        return MetricLabels(role=self.role, model_name=self.model.served_model_name, rank=rank)

    @property
    def model_dir(self) -> str:
        return self.model.model_path
