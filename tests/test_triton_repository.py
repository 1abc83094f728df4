"""The generated model repository, checked by parsing every config into Triton's ModelConfig."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from inference.errors import InvalidInput, ModelError
from inference.manifest import Manifest
from inference.settings import Settings
from inference.triton.names import served_names
from inference.triton.repository import (
    ENCODER,
    ENGINES_FILE,
    GPU_INSTANCES,
    POOLING,
    PREFERRED_BATCH_SIZES,
    VARIANT_ID_PARAM,
    RepoModel,
    cpu_sizing,
    generate_models,
    generate_repository,
    load_config,
    repository_target,
)

ENSEMBLE = "embedder"


def _dirs(repo: Path) -> dict[str, str]:
    """kind (encoder, pooling, embedder) -> the one model folder of that kind (a one-version repository)."""
    found = [d.name for d in repo.iterdir() if (d / "config.pbtxt").exists()]
    kinds = {name.split(".")[0]: name for name in found}
    assert len(kinds) == len(found), found
    return kinds


def _configs(repo: Path) -> dict[str, mc.ModelConfig]:
    return {kind: load_config(repo / name / "config.pbtxt") for kind, name in _dirs(repo).items()}


def test_cpu_repository_pools_inside_the_encoder(settings: Settings, manifest: Manifest, model_dir: Path,
                                                 tmp_path: Path) -> None:
    # Default CPU layout: one Python hop. The encoder emits the embedding; the ensemble has one step.
    generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="cpu", pooling_step=True)
    repo = generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="cpu", variant="int8")
    cfg = _configs(repo)
    assert set(cfg) == {ENCODER, ENSEMBLE}
    assert POOLING not in _dirs(repo), "a leftover pooling model would start an idle stub"
    enc = cfg[ENCODER]
    assert enc.backend == "python" and enc.platform == ""
    assert enc.max_batch_size == settings.triton.max_batch_size
    assert [i.name for i in enc.input] == list(manifest.inputs)
    assert all(i.data_type == mc.TYPE_INT32 and list(i.dims) == [-1] for i in enc.input)
    assert [(o.name, list(o.dims)) for o in enc.output] == [("last_hidden_state", [-1, manifest.dim]),
                                                            ("embedding", [manifest.dim])]
    assert enc.parameters["mode"].string_value == manifest.pooling
    assert enc.parameters["special_ids"].string_value == ",".join(map(str, manifest.special_ids))
    assert not enc.dynamic_batching.HasField("default_queue_policy")  # why: test_cpu_repository_two_steps
    (step,) = cfg[ENSEMBLE].ensemble_scheduling.step
    assert step.model_name == served_names(manifest, "int8").encoder
    assert dict(step.output_map) == {"embedding": "embedding"}
    assert {i.name for i in cfg[ENSEMBLE].input} == set(manifest.inputs)
    assert [o.name for o in cfg[ENSEMBLE].output] == ["embedding"]


def test_cpu_repository_two_steps(settings: Settings, manifest: Manifest, model_dir: Path, tmp_path: Path) -> None:
    repo = generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="cpu", variant="int8",
                               pooling_step=True)
    cfg = _configs(repo)
    enc = cfg[ENCODER]
    assert enc.backend == "python" and enc.platform == ""
    assert [(o.name, list(o.dims)) for o in enc.output] == [("last_hidden_state", [-1, manifest.dim])]
    assert "mode" not in enc.parameters
    (group,) = enc.instance_group
    assert group.kind == mc.ModelInstanceGroup.KIND_CPU
    sizing = cpu_sizing(settings)  # settings and this machine's cores (never oversubscribed: see below)
    assert (group.count, int(enc.parameters["intra_op_threads"].string_value)) == (sizing.instances,
                                                                                  sizing.ort_threads)
    assert Path(enc.parameters["onnx_path"].string_value) == (model_dir / manifest.variants["int8"].file).resolve()
    assert enc.dynamic_batching.max_queue_delay_microseconds == settings.triton.max_queue_delay_us
    assert list(enc.dynamic_batching.preferred_batch_size) == list(PREFERRED_BATCH_SIZES)
    assert (repo / _dirs(repo)[ENCODER] / "1" / "model.py").exists()
    assert (repo / _dirs(repo)[POOLING] / "1" / "model.py").exists()
    sys_path = enc.parameters["sys_path"].string_value.split(":")
    assert any(Path(p, "inference", "pooling.py").exists() for p in sys_path)
    assert any(Path(p, "onnxruntime").exists() for p in sys_path)

    pool = cfg[POOLING]
    assert pool.backend == "python" and pool.parameters["mode"].string_value == manifest.pooling
    assert [o.name for o in pool.output] == ["embedding"] and list(pool.output[0].dims) == [manifest.dim]
    assert pool.dynamic_batching.max_queue_delay_microseconds == 0  # never a wait: its input comes batched
    # No queue policy on a Python-backend model: one turns off Triton's payload prefetching and with
    # it on a batcher path that can lose its wake-up (500 ms); the encoder checks deadlines itself.
    assert not enc.dynamic_batching.HasField("default_queue_policy")
    assert not pool.dynamic_batching.HasField("default_queue_policy")

    ens = cfg[ENSEMBLE]
    assert ens.platform == "ensemble"
    steps = list(ens.ensemble_scheduling.step)
    names = served_names(manifest, "int8")
    assert [s.model_name for s in steps] == [names.encoder, names.pooling]
    assert steps[0].output_map["last_hidden_state"] == steps[1].input_map["last_hidden_state"]
    assert steps[1].input_map["attention_mask"] == "attention_mask"
    assert steps[1].output_map["embedding"] == "embedding"
    assert {i.name for i in ens.input} == set(manifest.inputs)
    assert repository_target(repo) == ("cpu", (manifest.variant_id("int8"),))
    assert ens.parameters[VARIANT_ID_PARAM].string_value == manifest.variant_id("int8")  # the sidecar checks it


def test_gpu_repository(settings: Settings, manifest: Manifest, model_dir: Path, tmp_path: Path) -> None:
    generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="cpu")
    repo = generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="gpu", variant="fp16",
                               project_root=Path("/opt/embedcar"))
    cfg = _configs(repo)
    enc = cfg[ENCODER]
    assert enc.platform == "tensorrt_plan" and enc.backend == ""
    assert enc.default_model_filename == "model.plan"
    assert enc.max_batch_size == settings.triton.max_batch_size
    (group,) = enc.instance_group
    assert group.kind == mc.ModelInstanceGroup.KIND_GPU and group.count == GPU_INSTANCES
    assert enc.dynamic_batching.max_queue_delay_microseconds == settings.triton.max_queue_delay_us
    assert not (repo / _dirs(repo)[ENCODER] / "1" / "model.py").exists(), "a CPU leftover would confuse Triton"
    assert cfg[POOLING].parameters["sys_path"].string_value == "/opt/embedcar"
    # A TensorRT plan cannot refuse expired requests itself: Triton's queue does it, from the
    # request's own timeout. The pooling step after it has nothing left to save.
    policy = enc.dynamic_batching.default_queue_policy
    assert policy.allow_timeout_override and policy.timeout_action == mc.ModelQueuePolicy.REJECT
    assert not cfg[POOLING].dynamic_batching.HasField("default_queue_policy")
    # ids types agree along the ensemble, whatever the target chose
    id_types = {i.data_type for i in enc.input} | {i.data_type for i in cfg[ENSEMBLE].input}
    assert len(id_types) == 1
    assert repository_target(repo) == ("gpu", (manifest.variant_id("fp16"),))


def test_excluding_special_pooling_wires_input_ids(settings: Settings, manifest: Manifest, model_dir: Path,
                                                   tmp_path: Path) -> None:
    m = dataclasses.replace(manifest, pooling="mean_excluding_special")
    cfg = _configs(generate_repository(settings, m, model_dir, out_dir=tmp_path, target="gpu"))
    assert "input_ids" in {i.name for i in cfg[POOLING].input}
    assert cfg[ENSEMBLE].ensemble_scheduling.step[1].input_map["input_ids"] == "input_ids"
    assert cfg[POOLING].parameters["special_ids"].string_value == ",".join(map(str, manifest.special_ids))


def test_settings_drive_batching_and_instances(settings: Settings, manifest: Manifest, model_dir: Path,
                                               tmp_path: Path) -> None:
    s = settings.with_section("triton", max_queue_delay_us=250, instances=3, ort_threads=1, max_batch_size=16)
    enc = _configs(generate_repository(s, manifest, model_dir, out_dir=tmp_path, target="cpu"))[ENCODER]
    assert enc.dynamic_batching.max_queue_delay_microseconds == 250
    assert list(enc.dynamic_batching.preferred_batch_size) == [4, 8, 16]  # 32 > max_batch_size dropped
    assert enc.instance_group[0].count == 3 and enc.parameters["intra_op_threads"].string_value == "1"
    assert enc.max_batch_size == 16
    assert enc.parameters["allow_spinning"].string_value == "0"  # spinning lost on a shared host: fixed off
    gpu = _configs(generate_repository(s.with_section("triton", instances=2), manifest, model_dir,
                                       out_dir=tmp_path, target="gpu"))[ENCODER]
    assert gpu.instance_group[0].count == 2 and gpu.max_batch_size == 16
    assert gpu.dynamic_batching.max_queue_delay_microseconds == 250


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 16])
def test_cpu_sizing_never_oversubscribes(settings: Settings, cores: int) -> None:
    sz = cpu_sizing(settings, cores)
    assert sz.instances >= 1 and sz.ort_threads >= 1
    assert sz.instances * sz.ort_threads <= max(cores, 1)


def test_regenerating_same_content_does_not_rewrite(settings: Settings, manifest: Manifest, model_dir: Path,
                                                    tmp_path: Path) -> None:
    repo = generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="cpu")
    files = sorted(p for p in repo.rglob("*") if p.is_file())
    before = {p: p.stat().st_mtime_ns for p in files}
    generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="cpu")
    assert {p: p.stat().st_mtime_ns for p in files} == before


def test_bad_inputs_are_clear_errors(settings: Settings, manifest: Manifest, model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="target"):
        generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="tpu")
    with pytest.raises(ModelError, match="variant"):
        generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="cpu", variant="int4")
    bad = tmp_path / "bad.pbtxt"
    bad.write_text('name: "x"\nmax_batch_sise: 4\n')
    with pytest.raises(ModelError, match="not a valid Triton model config"):
        load_config(bad)


def _other_version(manifest: Manifest) -> Manifest:
    """The same files under another version id (what a retrained model's manifest looks like to the names)."""
    return dataclasses.replace(manifest, version_id=manifest.version_id + "x")


def test_names_follow_the_model_and_its_variant(manifest: Manifest) -> None:
    a, b = served_names(manifest, "int8"), served_names(manifest, "fp32")
    assert a == served_names(manifest, "int8")  # deterministic: generator and clients agree
    assert a.ensemble != b.ensemble and a.ensemble != served_names(_other_version(manifest), "int8").ensemble
    assert served_names(manifest, "").ensemble == served_names(manifest, manifest.default_variant).ensemble
    assert a.ensemble.startswith(f"embedder.{manifest.name}.") and a.variant_id == manifest.variant_id("int8")
    odd = served_names(dataclasses.replace(manifest, name="shop/v2 model.x"), "int8")
    for name in (odd.ensemble, odd.encoder, odd.pooling):
        assert re.fullmatch(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[0-9a-f]{10}", name), name


def test_one_repository_holds_two_versions_and_drops_the_ones_not_asked_for(
        settings: Settings, manifest: Manifest, model_dir: Path, tmp_path: Path) -> None:
    s = settings
    old, new = RepoModel(manifest, model_dir, "int8"), RepoModel(_other_version(manifest), model_dir, "int8")
    repo = generate_models(s, [old, new], out_dir=tmp_path, target="cpu", pooling_step=True)
    for m in (old, new):
        ens = load_config(repo / m.names.ensemble / "config.pbtxt")
        assert [st.model_name for st in ens.ensemble_scheduling.step] == [m.names.encoder, m.names.pooling]
        assert ens.parameters[VARIANT_ID_PARAM].string_value == m.names.variant_id
    assert repository_target(repo) == ("cpu", (old.names.variant_id, new.names.variant_id))
    (repo / "mine").mkdir()
    (repo / "mine" / "config.pbtxt").write_text('name: "mine"\n')  # not generated: never removed
    generate_models(s, [new], out_dir=tmp_path, target="cpu", pooling_step=True)
    assert {d.name for d in repo.iterdir() if d.is_dir()} == {new.names.ensemble, new.names.encoder,
                                                              new.names.pooling, "mine"}
    with pytest.raises(InvalidInput, match="named twice"):
        generate_models(s, [new, new], out_dir=tmp_path, target="cpu")


def test_gpu_repository_lists_the_engines_to_build(settings: Settings, manifest: Manifest, model_dir: Path,
                                                   tmp_path: Path) -> None:
    repo = generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="gpu", variant="fp16")
    (line,) = (repo / ENGINES_FILE).read_text().splitlines()
    names = served_names(manifest, "fp16")
    assert line.split("\t") == [names.encoder, model_dir.name, manifest.variants["fp16"].file,
                                ",".join(manifest.inputs)]
    generate_repository(settings, manifest, model_dir, out_dir=tmp_path, target="cpu")
    assert not (repo / ENGINES_FILE).exists()
