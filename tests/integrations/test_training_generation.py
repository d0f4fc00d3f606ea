"""What training loops need of the engine besides fresh weights (tests/engine/test_training_coherence.py):
a model in train mode, a second model loaded with the policy's ``attn_implementation``, the
logprobs of the distribution actually sampled, suppressed tokens, memory let go between
generations, and TRL's GRPOTrainer generating through the engine.

transformers is the oracle: tokens teacher-forced against the model in eval mode, processed
logprobs against transformers' own logits warpers, suppressed tokens against its generate.
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_teacher_forced
from tiny_models import make_tiny_model, tiny_prompts
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import paged_hf

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(block_size=4, num_blocks=96)


def _lora(model, dropout=0.5):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=dropout,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights=False,
        ),
    )


def test_a_train_mode_peft_model_patches_and_generates_with_dropout_off():
    torch.manual_seed(0)
    model = _lora(make_tiny_model("llama"))
    assert model.training, "get_peft_model returns its model in train mode"
    prompts = tiny_prompts(model.config.vocab_size, 3, [5, 11, 17], seed=3)
    modes = [m.training for m in model.modules()]
    assert any(m.training for m in model.modules() if isinstance(m, torch.nn.Dropout))
    paged_hf.patch(model)
    outs = paged_hf.engine_for(model).generate(
        prompts, paged_hf.SamplingParams(max_new_tokens=8, ignore_eos=True)
    )
    assert [m.training for m in model.modules()] == modes, "every module keeps its mode"
    model.eval()
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(model, prompt, out.token_ids, what="train-mode PeftModel")
    model.train()
    x = torch.tensor([prompts[0]])
    assert not torch.equal(model(input_ids=x).logits, model(input_ids=x).logits), (
        "outside a step dropout still runs"
    )


def test_a_model_loaded_with_the_paged_implementation_runs_plain_forwards():
    """TRL builds its reference model with the policy's attn_implementation ("paged_hf")."""
    policy = make_tiny_model("llama")
    paged_hf.patch(policy)
    assert policy.config._attn_implementation == "paged_hf"
    ref = AutoModelForCausalLM.from_config(policy.config, attn_implementation="paged_hf").eval()
    ref.load_state_dict(policy.state_dict())
    sdpa = AutoModelForCausalLM.from_config(policy.config, attn_implementation="sdpa").eval()
    sdpa.load_state_dict(policy.state_dict())
    x = torch.tensor([tiny_prompts(policy.config.vocab_size, 1, [13], seed=4)[0]])
    with torch.no_grad():
        assert torch.allclose(ref(input_ids=x).logits, sdpa(input_ids=x).logits, atol=1e-6)
    paged_hf.patch(ref)  # an engine on it patches it as usual, and its plain forwards stay sdpa's
    with torch.no_grad():
        assert torch.allclose(ref(input_ids=x).logits, sdpa(input_ids=x).logits, atol=1e-6)
    out = paged_hf.engine_for(ref).generate(
        [x[0].tolist()], paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True)
    )
    assert_teacher_forced(
        sdpa, x[0].tolist(), out[0].token_ids, what="engine on a model loaded as paged_hf"
    )


@pytest.mark.parametrize(
    "knobs",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(temperature=0.9, top_p=0.8),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    ],
)
def test_processed_logprobs_are_transformers_processed_distribution(knobs):
    model = make_tiny_model("llama")
    prompts = tiny_prompts(model.config.vocab_size, 2, [6, 14], seed=5)
    params = paged_hf.SamplingParams(
        max_new_tokens=8, ignore_eos=True, seed=3, logprobs=3, logprobs_mode="processed", **knobs
    )
    outs = paged_hf.Engine(model, **SMALL).generate(prompts, params)
    warpers = LogitsProcessorList(
        [TemperatureLogitsWarper(knobs["temperature"])]
        + ([TopKLogitsWarper(knobs["top_k"])] if knobs.get("top_k") else [])
        + ([TopPLogitsWarper(knobs["top_p"])] if knobs.get("top_p") else [])
        + ([MinPLogitsWarper(knobs["min_p"])] if knobs.get("min_p") else [])
    )
    raw = paged_hf.Engine(model, **SMALL).generate(prompts, params.with_(logprobs_mode="raw"))
    for prompt, out, plain in zip(prompts, outs, raw):
        assert out.token_ids == plain.token_ids, (
            "the mode changes what is reported, not what is sampled"
        )
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        for i, (tok, (chosen, top)) in enumerate(zip(out.token_ids, out.completions[0].logprobs)):
            pos = len(prompt) - 1 + i
            expected = torch.log_softmax(
                warpers(ids[:, : pos + 1], logits[pos][None].clone())[0], dim=-1
            )
            assert abs(chosen - float(expected[tok])) < 1e-4, (i, chosen, float(expected[tok]))
            for t, v in top.items():
                assert abs(v - float(expected[t])) < 1e-4 or (
                    v == float("-inf") and expected[t] == float("-inf")
                )
            assert chosen > float("-inf"), "a sampled token had probability > 0 where it was drawn"


def test_processed_logprobs_of_greedy_requests_are_of_their_masked_logits():
    model = make_tiny_model("llama")
    prompt = tiny_prompts(model.config.vocab_size, 1, [9], seed=6)[0]
    engine = paged_hf.Engine(model, **SMALL)
    base = paged_hf.SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=1)
    raw = engine.generate([prompt], base)[0]
    first = raw.token_ids[0]
    out = engine.generate(
        [prompt], base.with_(logprobs_mode="processed_logprobs", begin_suppress_tokens=(first,))
    )[0]
    assert out.token_ids[0] != first
    # finite, renormalised
    assert out.completions[0].logprobs[0][0] > raw.completions[0].logprobs[1][0] - 50
    assert first not in out.completions[0].logprobs[0][1]


@pytest.mark.parametrize("which", ["suppress_tokens", "begin_suppress_tokens"])
def test_suppressed_tokens_match_transformers_generate(which):
    reference, model = make_tiny_model("llama"), make_tiny_model("llama")
    prompts = tiny_prompts(model.config.vocab_size, 2, [7, 12], seed=8)
    paged_hf.patch(model)
    first = [
        model.generate(torch.tensor([p]), max_new_tokens=1, do_sample=False)[0, -1].item()
        for p in prompts
    ]
    banned = sorted(set(first))
    for prompt in prompts:
        x = torch.tensor([prompt])
        kwargs = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6, **{which: banned})
        expected = reference.generate(x, **kwargs)[0, len(prompt) :].tolist()
        got = model.generate(x, **kwargs)[0, len(prompt) :].tolist()
        assert got == expected
        assert got[0] not in banned and (
            which == "begin_suppress_tokens" or not set(got) & set(banned)
        )


def test_bad_logprobs_mode_and_suppressed_ids_are_refused():
    with pytest.raises(ValueError, match="logprobs_mode"):
        paged_hf.SamplingParams(logprobs_mode="logits").validate()
    with pytest.raises(ValueError, match="suppress_tokens"):
        paged_hf.SamplingParams(suppress_tokens=[-3]).validate()


def test_sleep_lets_go_of_the_kv_cache_and_the_next_step_wakes_it():
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    prompts = tiny_prompts(model.config.vocab_size, 3, [5, 9, 30], seed=9)
    params = paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = paged_hf.Engine(model, **SMALL)
    before = [o.token_ids for o in engine.generate(prompts, params)]
    kv = engine.runner.backend.kv[0]
    engine.sleep()
    assert engine.is_sleeping and engine.runner.backend is None and engine.stats()["asleep"]
    assert engine.kv_manager.pool.num_cached == 0, "the cached prefixes went with the memory"
    assert [o.token_ids for o in engine.generate(prompts, params)] == before
    assert not engine.is_sleeping and engine.runner.backend.kv[0] is not kv
    rid = engine.add_request(prompts[0], params)
    with pytest.raises(RuntimeError, match="still live"):
        engine.sleep()
    engine.run_until_done([rid])


@pytest.mark.parametrize("peft", [False, True])
def test_a_tiny_grpo_run_generates_through_the_engine_on_each_steps_weights(peft, tmp_path):
    """Two GRPO steps with TRL's default (fused AdamW) optimizer: every generation goes through the
    engine, n = num_generations per prompt, and after each step a greedy probe equals transformers
    on that step's weights."""
    from datasets import Dataset
    from tiny_tokenizer import make_tiny_tokenizer
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from paged_hf.integrations.trl import PagedGenerationMixin

    tokenizer = make_tiny_tokenizer()
    model = make_tiny_model("llama")
    probe = tiny_prompts(model.config.vocab_size, 1, [10], seed=10)[0]
    calls, probes = [], []

    class Trainer(PagedGenerationMixin, GRPOTrainer):
        paged_hf_options = SMALL

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            calls.append(
                (len(prompt_ids), paged_hf.engine_for(self.accelerator.unwrap_model(self.model)))
            )
            return out

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            engine = calls[-1][1]
            out = engine.generate(
                [probe], paged_hf.SamplingParams(max_new_tokens=5, ignore_eos=True)
            )[0]
            probes.append(out.token_ids)
            policy = trainer.accelerator.unwrap_model(trainer.model)
            was = policy.training
            policy.eval()
            assert_teacher_forced(
                policy, probe, out.token_ids, what=f"after GRPO step {state.global_step}"
            )
            policy.train(was)

    data = Dataset.from_dict({"prompt": ["a b c", "d e f", "g h", "i j k l"]})
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        learning_rate=0.05,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        bf16=False,
    )  # TRL defaults to bf16 autocast; the oracle check is fp32
    assert args.optim in ("adamw_torch_fused", "adamw_torch")
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

    # varies across a prompt's samples, so advantages (and updates) are not 0
    def reward(completions, **kw):
        return [float(sum(map(ord, c)) % 7) for c in completions]

    trainer = Trainer(
        model=model,
        args=args,
        reward_funcs=reward,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Probe()],
    )
    before = {
        k: v.clone()
        for k, v in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
        if v.requires_grad
    }
    trainer.train()
    after = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    assert any(not torch.equal(v, after[k]) for k, v in before.items()), (
        "the steps must move the weights"
    )
    assert len(calls) >= 2 and all(n == 4 for n, _ in calls), calls
    assert len(probes) == 2
