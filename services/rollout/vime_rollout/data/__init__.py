"""Prompt data: files and the synthetic task → tokenised datasets → groups of samples."""

from vime_rollout.data.dataset import DatasetError, PromptDataset, PromptTemplate, Tokenizer, build_dataset
from vime_rollout.data.records import DataFileError, read_records
from vime_rollout.data.source import DataSource, DataStateError, MalformedDataState

__all__ = [
    "DataFileError",
    "DataSource",
    "DataStateError",
    "DatasetError",
    "MalformedDataState",
    "PromptDataset",
    "PromptTemplate",
    "Tokenizer",
    "build_dataset",
    "read_records",
]
