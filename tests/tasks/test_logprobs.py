"""Chunked completion log-probs (:mod:`rankwise.tasks.logprobs`) against the plain path from the
model's logits: DPO's loss (policy and adapters-off reference), its precomputed reference log-probs
and GRPO's loss, reference and
per-token log-probs, and every trainable gradient, equal to 1e-5 (fp32) on a tiny Llama (LoRA on
the blocks and on ``lm_head``) and a tiny GPT-2 (tied embeddings, full fine-tuning); Gemma 2's
soft-capping, Cohere's logit scale and Granite's logit scaling applied in each chunk; a model
with an unknown transform computed unchunked with a warning; ``train.loss_chunk_tokens``
reaching every task that reads completion log-probs (dpo, kto, orpo, simpo, grpo, rloo) through
``rankwise train``'s session. KTO's, ORPO's, SimPO's and RLOO's chunked-vs-unchunked tests sit
with their parity tests (``tests/tasks/kto``, ``tests/tasks/test_reference_free.py``,
``tests/tasks/rloo``)."""
from __future__ import annotations

import copy

import pytest
import torch

from rankwise import registry
from rankwise.adapters.lora.config import LoraConfig
from rankwise.core.protocol import adapter_modules, factors
from rankwise.tasks.dpo.task import DPOConfig, DPOTask, reference_logps
from rankwise.tasks.grpo.data import PromptData
from rankwise.tasks.grpo.task import GRPOConfig, GRPOTask, rows_of, token_logps
from rankwise.tasks.logprobs import logits_logps, target_logps
from rankwise.tasks.pairs import PairData
from rankwise.tasks.reference import WeightSnapshot
from rankwise.testing import VOCAB, tiny_gpt2_lm, tiny_llama_lm
from tests.tasks.pair_fixtures import assert_same_grads, grads, pairs as random_pairs, tokenizer

G, MAX_NEW = 4, 8


def model_of(family: str) -> torch.nn.Module:
    """Llama with non-zero LoRA factors on q/v/down and ``lm_head``; GPT-2 whole (its head is
    the input embedding, tied: the gradient of both uses arrives in one tensor)."""
    if family == "gpt2":
        model = tiny_gpt2_lm(seed=0)
        assert model.lm_head.weight is model.transformer.wte.weight
        return model.train()
    model = tiny_llama_lm(seed=0)
    registry.get("method", "lora").apply(model, LoraConfig(r=4, alpha=8.0,
                                                           targets=["q_proj", "v_proj", "down_proj", "lm_head"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, mod in adapter_modules(model):
            for w in factors(mod, "default"):
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    return model.train()


def pairs(seed: int = 3, n: int = 4) -> list[dict]:
    """Random pairs: a shared prompt (no target) and completions of 1-8 tokens (padding)."""
    return random_pairs(seed, n, longest=8)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_loss_reference_and_gradients_equal_the_unchunked_path(family, loss):
    base = model_of(family)
    batch = DPOTask().collate(pairs(), pad_id=0)
    if family == "gpt2":  # no adapters to switch off: a reference the pairs carry
        batch["ref_logps"] = -20.0 - 5 * torch.rand(4, 2, generator=torch.Generator().manual_seed(1))
    runs = {}
    for chunk in (0, 1, 3, 1000):
        model = copy.deepcopy(base)
        task = DPOTask(DPOConfig(loss=loss, beta=0.5, reference="adapters-off"))
        task.loss_chunk_tokens = chunk
        total, out = task.loss_sum(model, batch)
        total.backward()
        with torch.no_grad():
            logps, counts, output = task.sequence_logps(model, batch)
        stored = torch.tensor(reference_logps(task, model, PairData(pairs(), 0), 3, "cpu"))  # precomputed
        runs[chunk] = float(total.detach()), out, grads(model), counts, output, stored
    ref_total, ref_out, ref_grads, ref_counts, _, ref_stored = runs[0]
    for chunk in (1, 3, 1000):
        total, out, got, counts, output, stored = runs[chunk]
        torch.testing.assert_close(stored, ref_stored, rtol=1e-5, atol=1e-5)
        assert total == pytest.approx(ref_total, abs=1e-5, rel=1e-5), chunk
        torch.testing.assert_close(out.logps, ref_out.logps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.rewards, ref_out.rewards, rtol=1e-5, atol=1e-5)  # the reference too
        assert torch.equal(counts, ref_counts)
        assert output.logits.numel() == 0                   # the full logits never formed
        assert_same_grads(got, ref_grads)
    assert float(ref_out.rewards.abs().sum()) > 0.1         # policy and reference differ


def injected(seed: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    """Two prompts and ``G`` completions each, of different lengths (1..MAX_NEW tokens)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 5)]
    comps = [torch.randint(1, VOCAB, (int(torch.randint(1, MAX_NEW + 1, (1,), generator=g)),),
                           generator=g).tolist() for _ in range(2 * G)]
    return prompts, comps


def reward(prompts, completions, **kwargs):
    return [float(len(c.split()) % 3) for c in completions]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("loss_type,temperature", [("dapo", 1.0), ("grpo", 0.7)])
def test_grpo_loss_reference_and_gradients_equal_the_unchunked_path(family, loss_type, temperature):
    base = model_of(family)
    prompts, comps = injected()
    tok = tokenizer()
    data = PromptData(prompts, [tok.decode(p) for p in prompts], {}, [1, 2], 0, tok)
    runs = {}
    for chunk in (0, 5):
        model = copy.deepcopy(base)
        task = GRPOTask(GRPOConfig(num_generations=G, max_completion_length=MAX_NEW, beta=0.1,
                                   loss_type=loss_type, rewards=["exact-match"], temperature=temperature))
        task.fns = {"reward": reward}
        task.loss_chunk_tokens = chunk
        task.prepare(model, [data], family == "gpt2", 2, "cpu")
        if family == "gpt2":  # full fine-tuning: perturbed initial weights as the reference
            task.snapshot, g = WeightSnapshot(model), torch.Generator().manual_seed(2)
            task.snapshot.pairs = [(p, s + 0.05 * torch.randn(s.shape, generator=g)) for p, s in task.snapshot.pairs]
        rolled = task.rollout(model, task.collate([data[0], data[1]], 0), completions=comps)
        total, _ = task.loss_sum(model, rolled)
        total.backward()
        runs[chunk] = float(total.detach()), rolled, grads(model)
    (total, rolled, got), (ref_total, ref_rolled, ref_grads) = runs[5], runs[0]
    mask = rolled["completion_mask"].bool()
    assert total == pytest.approx(ref_total, abs=1e-5, rel=1e-5)
    torch.testing.assert_close(rolled["ref_logps"][mask], ref_rolled["ref_logps"][mask], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        policy = token_logps(base, ref_rolled, temperature)
    assert float((policy - ref_rolled["ref_logps"])[mask].abs().max()) > 1e-2  # the reference is another model
    assert not mask.all()                                   # padded completions
    assert_same_grads(got, ref_grads)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_grpo_token_logps_are_the_plain_ones_on_completion_tokens_and_0_on_padding(family):
    model = model_of(family)
    prompts, comps = injected()
    rows = rows_of(prompts, comps, G, 0)
    mask = rows["completion_mask"].bool()
    plain = token_logps(model, rows, 0.7)
    got = token_logps(model, rows, 0.7, chunk_tokens=4)
    assert got.shape == plain.shape
    torch.testing.assert_close(got[mask], plain[mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    (got * mask).sum().backward()
    chunked = grads(model)
    model.zero_grad(set_to_none=True)
    (plain * mask).sum().backward()
    assert_same_grads(chunked, grads(model))


def family_with_transform(family: str) -> torch.nn.Module:
    """Tiny models whose forward changes the head's output, with values where it matters."""
    import transformers as tf
    small = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                 pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    if family == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**small, head_dim=8, final_logit_softcapping=2.0))
    elif family == "cohere":
        model = tf.CohereForCausalLM(tf.CohereConfig(**small, logit_scale=0.5))
    else:
        model = tf.GraniteForCausalLM(tf.GraniteConfig(**small, logits_scaling=4.0))
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)                  # logits of a few units: the cap bends them
    return model.train()


def lm_batch(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 10), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, 8:] = -100
    return ids, labels


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_a_known_logit_transform_is_applied_in_each_chunk(family):
    model = family_with_transform(family)
    ids, labels = lm_batch()
    plain = logits_logps(model(input_ids=ids).logits, labels)
    plain.sums().sum().backward()
    ref_grads = grads(model)
    model.zero_grad(set_to_none=True)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out))
    got = target_logps(model, lambda: (model(input_ids=ids), {"labels": labels}), 3)
    assert got.chunked and got.output.logits.numel() == 0
    torch.testing.assert_close(got.sums(), plain.sums(), rtol=1e-5, atol=1e-5)
    got.sums().sum().backward()
    hook.remove()
    assert_same_grads(grads(model), ref_grads)
    assert seen[0].shape == (3, 10, 0) and seen[1].shape == (1, 3, VOCAB)  # placeholder, the probe
    assert [out.shape[0] for out in seen[2:]] == [3] * 5 + [1] + [1] + [3] * 5  # 16 targets, recomputed
    with torch.no_grad():
        untransformed = logits_logps(model.lm_head(model.model(input_ids=ids).last_hidden_state), labels)
    assert (untransformed.values - plain.values.detach()).abs().max() > 1e-2   # the transform matters


def test_a_model_that_changes_its_logits_another_way_is_computed_unchunked():
    model = tiny_llama_lm(seed=0).train()
    forward = type(model).forward

    def doubled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = 2.0 * out.logits
        return out

    model.forward = doubled.__get__(model)
    ids, labels = lm_batch()
    plain = logits_logps(model(input_ids=ids).logits, labels)
    with pytest.warns(UserWarning, match="does not know.*unchunked"):
        got = target_logps(model, lambda: (model(input_ids=ids), {"labels": labels}), 3)
    assert not got.chunked and got.output.logits.shape == (3, 10, VOCAB)
    torch.testing.assert_close(got.values, plain.values, rtol=1e-6, atol=1e-6)
    again = target_logps(model, lambda: (model(input_ids=ids), {"labels": labels}), 3)  # no second warning
    assert not again.chunked


def test_train_loss_chunk_tokens_reaches_every_log_prob_task(tmp_path):
    from tests.tasks.test_task_contract import example_config
    from rankwise.recipes.session import prepare
    for name in ("dpo", "kto", "orpo", "simpo", "grpo", "rloo"):
        for sub in (name, f"{name}-auto"):
            (tmp_path / sub).mkdir()
        session = prepare(example_config(name, tmp_path / name, loss_chunk_tokens=4), device="cpu")
        assert session.task.loss_chunk_tokens == 4
        auto = prepare(example_config(name, tmp_path / f"{name}-auto"), device="cpu")
        assert auto.task.loss_chunk_tokens == 0              # auto: a small vocabulary stays plain


@pytest.mark.slow  # three 2-step runs per task through rankwise train's recipe
@pytest.mark.parametrize("name", ["dpo", "kto", "orpo", "simpo", "grpo", "rloo"])
def test_a_chunked_run_resumes_exactly_and_follows_the_unchunked_run(name, tmp_path, monkeypatch):
    """The task contract's run + exact resume with every model chunked (4 positions a chunk),
    and its metrics equal an unchunked run's."""
    from rankwise.recipes.sections import TrainConfig
    from rankwise.recipes.train import train
    from rankwise.tasks import logprobs
    from tests.tasks.test_task_contract import check_run, example_config
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain = train(example_config(name, plain_dir, steps=2, save_every=1), plain_dir / "run")
    calls = []
    real = logprobs.chunked_logps
    monkeypatch.setattr(logprobs, "chunked_logps", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(TrainConfig, "AUTO_CHUNK_VOCAB", 1)
    monkeypatch.setattr(TrainConfig, "AUTO_CHUNK_TOKENS", 4)
    (tmp_path / "chunked").mkdir()
    chunked = check_run(name, tmp_path / "chunked")
    assert calls                                            # the chunked path ran
    evals = [k for k in plain if k.startswith("eval_") and "memory" not in k]
    off = {k: (plain[k], chunked[k]) for k in evals if chunked[k] != pytest.approx(plain[k], rel=1e-5, abs=2e-6)}
    assert evals and not off, off                           # metrics.json rounds to 6 decimals
    if "eval_peak_memory_mb" in plain:                      # the evaluation forms no logits either
        assert chunked["eval_peak_memory_mb"] <= plain["eval_peak_memory_mb"]
