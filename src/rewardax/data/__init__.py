"""Preference data: sources, formats, tokenization, length policy, batching, the resumable loader."""

from rewardax.data.collate import (
    BATCH_KEYS,
    collate_records,
    create_grain_collect_function,
    create_tfds_collect_function,
    default_bucket_lengths,
)
from rewardax.data.config import DataConfig
from rewardax.data.formats import FORMATS, detect_dataset_format, detect_format, normalize_row
from rewardax.data.groups import GROUP_KEYS, collate_groups
from rewardax.data.loader import LoaderStats, PreferenceLoader, iterate_eval_batches
from rewardax.data.packing import (
    PACKED_KEYS,
    SHARED_PROMPT_KEYS,
    common_prefix_length,
    group_row_lengths,
    pack_groups,
    pack_records,
    packing_row_lengths,
    token_counts,
)
from rewardax.data.sources import (
    HFDatasetSource,
    ListSource,
    ShardedDataSource,
    StreamSource,
    as_data_source,
    load_eval_sources,
    load_source,
)
from rewardax.data.tokenize import PairEncoder, pad_token_id

__all__ = [
    "BATCH_KEYS",
    "FORMATS",
    "GROUP_KEYS",
    "PACKED_KEYS",
    "SHARED_PROMPT_KEYS",
    "DataConfig",
    "HFDatasetSource",
    "ListSource",
    "LoaderStats",
    "PairEncoder",
    "PreferenceLoader",
    "ShardedDataSource",
    "StreamSource",
    "as_data_source",
    "collate_groups",
    "collate_records",
    "common_prefix_length",
    "create_grain_collect_function",
    "create_tfds_collect_function",
    "default_bucket_lengths",
    "detect_dataset_format",
    "detect_format",
    "group_row_lengths",
    "iterate_eval_batches",
    "load_eval_sources",
    "load_source",
    "normalize_row",
    "pack_groups",
    "pack_records",
    "packing_row_lengths",
    "pad_token_id",
    "token_counts",
]
