"""The client API: workers, tables, tensor layouts, in-process clusters."""

from mltuner.client._cluster import LocalCluster
from mltuner.client._layout import TensorLayout, TensorSlot
from mltuner.client._worker import PlanPreview, Table, Worker

__all__ = ["LocalCluster", "PlanPreview", "TensorLayout", "TensorSlot", "Table", "Worker"]
