"""One pipeline stage of a model, built and loaded in this process (no process group is
needed until a step runs): which layers and weights each stage holds."""

import pytest
import torch
from safetensors.torch import load_file

from tidal.kernels.attention import select_attention_backend
from tidal.workers.distributed import PipelineParallel, TensorParallel
from tidal.workers.loader import load_weights, read_config
from tidal.workers.models.llama import build_model, parse_model_args


def test_layers_split_into_contiguous_runs_differing_by_at_most_one():
    runs = [list(PipelineParallel(s, 3).layers(8)) for s in range(3)]
    assert runs == [[0, 1], [2, 3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is larger than the model's "
                                         "num_hidden_layers=2"):
        PipelineParallel(0, 3).layers(2)


def _stage(model_dir: str, stage: int, size: int):
    args = parse_model_args(read_config(model_dir))
    backend = select_attention_backend("auto", "cpu", torch.float32)
    with torch.device("cpu"):
        model = build_model(args, TensorParallel(), backend, 64, PipelineParallel(stage, size))
    load_weights(model, model_dir)  # every tensor of this stage filled, none of another's
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_each_stage_loads_only_its_own_weights(tiny_model_factory, tied):
    """Stage 0 of 2: the embedding and layer 0; stage 1: layer 1, the norm and the LM head,
    which, with tied embeddings, loads the checkpoint's embedding matrix itself."""
    model_dir = tiny_model_factory("llama", tie_word_embeddings=tied)
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    first, last = _stage(model_dir, 0, 2), _stage(model_dir, 1, 2)
    names = lambda m: {n.split(".")[1] if n.startswith("model.") else n.split(".")[0]
                       for n, _ in m.named_parameters()}
    assert names(first) == {"embed_tokens", "layers"} and list(first.model.layers) == ["0"]
    assert names(last) == {"layers", "norm", "lm_head"} and list(last.model.layers) == ["1"]
    head = checkpoint["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert torch.equal(last.lm_head.weight[:head.shape[0]], head)
    assert first.num_layers == last.num_layers == 1
