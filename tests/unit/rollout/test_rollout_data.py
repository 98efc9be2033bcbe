"""The data source: files → tokenised prompts (too-long ones dropped and counted) → groups of deep
copies numbered as in seed step 16, and a position that survives a save/restore."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from vime_rollout.data import (
    DataFileError,
    DatasetError,
    DataSource,
    DataStateError,
    MalformedDataState,
    build_dataset,
    read_records,
)
from vime_rollout.data.synthetic import arithmetic_records

from vime.types import SampleStatus


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _dataset(tokenizer: Any, records: list[dict[str, Any]], max_len: int = 512, **kw: Any) -> Any:
    args = {
        "input_key": "prompt",
        "label_key": "label",
        "metadata_key": "metadata",
        "apply_chat_template": False,
    }
    args.update(kw)
    return build_dataset("t", records, tokenizer, max_prompt_len=max_len, **args)


def test_jsonl_and_parquet_give_the_same_records(tmp_path: Path) -> None:
    records = [{"prompt": f"{i}+1=", "label": i + 1} for i in range(5)]
    jl = _write_jsonl(tmp_path / "p.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    assert list(read_records(jl)) == records
    assert list(read_records(tmp_path / "p.parquet")) == records


def test_bad_files_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(DataFileError, match=r"bad.jsonl:2"):
        list(read_records(bad))
    with pytest.raises(DataFileError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataFileError, match="unknown format"):
        read_records(tmp_path / "x.csv")


def test_prompts_longer_than_the_limit_are_dropped_and_counted(tokenizer: Any) -> None:
    records = [{"prompt": "x" * n, "label": n} for n in (3, 10, 11, 30, 5)]
    ds = _dataset(tokenizer, records, max_len=10)
    assert [p.label for p in ds.prompts] == [3, 10, 5]
    assert ds.num_dropped_too_long == 2 and ds.num_records == 5
    assert all(len(p.token_ids) <= 10 for p in ds.prompts)


def test_nothing_left_or_missing_key_is_an_error(tokenizer: Any) -> None:
    with pytest.raises(DatasetError, match="2 longer than rollout_max_prompt_len=4"):
        _dataset(tokenizer, [{"prompt": "xxxxx"}, {"prompt": "yyyyyy"}], max_len=4)
    with pytest.raises(DatasetError, match="no 'question' field"):
        _dataset(tokenizer, [{"prompt": "a"}], input_key="question")


def test_chat_template_renders_messages(tokenizer: Any) -> None:
    ds = _dataset(tokenizer, [{"prompt": "hi", "label": 1}], apply_chat_template=True)
    text = tokenizer.decode(list(ds.prompts[0].token_ids))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(DatasetError, match="apply_chat_template"):
        _dataset(tokenizer, [{"prompt": [{"role": "user", "content": "hi"}]}])


def test_groups_are_numbered_deep_copies(tokenizer: Any) -> None:
    records = [
        {"prompt": f"{i}+{i}=", "label": 2 * i, "metadata": {"rm_type": "arithmetic"}} for i in range(4)
    ]
    src = DataSource(_dataset(tokenizer, records), 8, shuffle=False)
    groups = src.get_samples(4)
    assert [len(g) for g in groups] == [8, 8, 8, 8]
    assert [s.group_index for g in groups for s in g] == [i // 8 for i in range(32)]
    assert [s.index for g in groups for s in g] == list(range(32))
    assert len({s.session_id for g in groups for s in g}) == 32
    first = groups[0]
    assert all(s.tokens == first[0].tokens and s.label == 0 for s in first)
    first[0].tokens.append(99)
    first[0].metadata["x"] = 1
    assert first[1].tokens != first[0].tokens and "x" not in first[1].metadata
    assert groups[1][0].metadata == {"rm_type": "arithmetic"}
    nested = DataSource(_dataset(tokenizer, [{"prompt": "a", "label": [1, 2], "metadata": {"k": [1]}}]), 2)
    a, b = nested.get_samples(1)[0]
    a.label.append(3)
    a.metadata["k"].append(2)
    assert b.label == [1, 2] and b.metadata == {"k": [1]}
    assert first[0].status is SampleStatus.PENDING and first[0].response_length == 0
    # Counting goes on across calls (seed: 0..31 groups, 0..255 samples over a run).
    assert src.get_samples(1)[0][0].index == 32


def test_epochs_reshuffle_deterministically(tokenizer: Any) -> None:
    ds = _dataset(tokenizer, list(arithmetic_records(10, seed=1)))
    a, b = DataSource(ds, 1, seed=7), DataSource(ds, 1, seed=7)
    seq_a = [g[0].prompt for g in a.get_samples(25)]
    assert seq_a == [g[0].prompt for g in b.get_samples(25)]
    epoch0, epoch1 = seq_a[:10], seq_a[10:20]
    assert sorted(epoch0) == sorted(epoch1) == sorted(p.prompt for p in ds.prompts)
    assert epoch0 != epoch1
    assert a.epoch == 2 and a.offset == 5


def test_position_save_and_restore_continues_the_sequence(tokenizer: Any) -> None:
    ds = _dataset(tokenizer, list(arithmetic_records(7, seed=3)))
    src = DataSource(ds, 2, seed=5)
    src.get_samples(9)
    aborted = src.get_samples(1)
    aborted[0][0].append_response_tokens([5, 6], text="ab")
    aborted[0][0].status = SampleStatus.ABORTED
    src.add_samples(aborted)
    state = json.loads(json.dumps(src.state_dict()))  # plain JSON all the way

    restored = DataSource(ds, 2, seed=0)
    restored.load_state_dict(state)
    expected = src.get_samples(6)
    got = restored.get_samples(6)
    assert [[s.model_dump() for s in g] for g in got] == [[s.model_dump() for s in g] for g in expected]
    # The handed-back group comes first and keeps its partial response.
    assert got[0][0].response_tokens == [5, 6] and got[0][0].status is SampleStatus.ABORTED


def test_restore_refuses_a_state_of_another_dataset(tokenizer: Any) -> None:
    src = DataSource(_dataset(tokenizer, list(arithmetic_records(7, seed=3))), 2)
    other = DataSource(_dataset(tokenizer, list(arithmetic_records(8, seed=3))), 2)
    with pytest.raises(DataStateError, match="saved for 7 prompts"):
        other.load_state_dict(src.state_dict())
    with pytest.raises(DataStateError, match="malformed"):
        src.load_state_dict({"version": 1, "dataset_size": 7, "n_samples_per_prompt": 2})
    with pytest.raises(ValueError, match="3 samples, not 2"):
        src.add_samples([src.get_samples(1)[0] + src.get_samples(1)[0][:1]])


def test_restore_refuses_numbers_out_of_range_naming_the_field(tokenizer: Any) -> None:
    """Issue 17: a huge ``sample_index`` was taken, and every later batch failed with OverflowError
    (int64 indices). Each field is checked before anything changes."""
    src = DataSource(_dataset(tokenizer, list(arithmetic_records(7, seed=3))), 2)
    src.get_samples(2)
    aborted = src.get_samples(1)[0]
    for s in aborted:
        s.append_response_tokens([5, 6])
    src.add_samples([aborted])
    good = json.loads(json.dumps(src.state_dict()))
    bad_cases = {
        "state.sample_index": {"sample_index": 2**70},
        "state.sample_group_index": {"sample_group_index": -1},
        "state.epoch": {"epoch": 1e300},
        "state.offset": {"offset": 8},
        "state.seed": {"seed": "x"},
        "state.buffer.0.1.tokens": {
            "buffer": [[good["buffer"][0][0], {**good["buffer"][0][1], "tokens": [2**40]}]]
        },
        "state.buffer.0.0.index": {
            "buffer": [[{**good["buffer"][0][0], "index": 2**60}, good["buffer"][0][1]]]
        },
        "state.buffer.0.0: loss_mask": {
            "buffer": [[{**good["buffer"][0][0], "loss_mask": []}, good["buffer"][0][1]]]
        },
    }
    restored = DataSource(_dataset(tokenizer, list(arithmetic_records(7, seed=3))), 2)
    before = restored.state_dict()
    for field, change in bad_cases.items():
        with pytest.raises(MalformedDataState) as err:
            restored.load_state_dict({**good, **change})
        assert field in str(err.value) and err.value.status_code == 422, (field, str(err.value))
        assert restored.state_dict() == before  # nothing was half-restored
    restored.load_state_dict(good)
    assert restored.state_dict() == good


def test_synthetic_task_is_deterministic_and_labelled() -> None:
    a = list(arithmetic_records(50, seed=42))
    assert a == list(arithmetic_records(50, seed=42))
    assert a != list(arithmetic_records(50, seed=43))
    for r in a:
        x, y = r["prompt"].rstrip("=").split("+")
        assert r["label"] == int(x) + int(y) and r["metadata"] == {"rm_type": "arithmetic"}


def test_without_a_data_file_the_synthetic_task_and_a_held_out_eval_are_used(tokenizer: Any) -> None:
    from vime_rollout.factory import build_datasets
    from vime_rollout.scorer import reward_request

    from vime.config import load_config

    cfg = load_config(overrides=["data.synthetic_num_prompts=50", "rollout_seed=3"])
    train, evals = build_datasets(cfg, tokenizer)
    assert train.name == "arithmetic" and len(train) == 50
    assert list(evals) == ["arithmetic"] and len(evals["arithmetic"]) == 64
    train_prompts = {p.prompt for p in train.prompts}
    assert train_prompts != {p.prompt for p in evals["arithmetic"].prompts}
    sample = DataSource(train, 2).get_samples(1)[0][0]
    req = reward_request(sample)
    # No custom function configured: the reward service picks the verifier from metadata.rm_type.
    assert req.metadata["rm_type"] == "arithmetic" and req.label == int(
        sample.prompt[:-1].split("+")[0]
    ) + int(sample.prompt[:-1].split("+")[1])


def test_a_data_file_replaces_the_synthetic_task(tokenizer: Any, tmp_path: Path) -> None:
    from vime_rollout.factory import build_datasets

    from vime.config import load_config

    data = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q" * n, "answer": n} for n in (1, 2, 99)])
    ev = _write_jsonl(tmp_path / "e.jsonl", [{"question": "e", "answer": 0}])
    cfg = load_config(
        overrides=[
            f"data.prompt_data={data}",
            "data.input_key=question",
            "data.label_key=answer",
            f"data.eval_prompt_data={{gsm: {ev}}}",
            "rollout_max_prompt_len=10",
            "rollout_max_response_len=10",
        ]
    )
    train, evals = build_datasets(cfg, tokenizer)
    assert [p.label for p in train.prompts] == [1, 2] and train.num_dropped_too_long == 1
    assert list(evals) == ["gsm"] and evals["gsm"].prompts[0].label == 0
