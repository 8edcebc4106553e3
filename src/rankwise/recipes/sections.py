"""The sections of a run config that every run has: ``model``, ``data``, ``train``, ``eval``.

Their defaults live here (and in each registered entry's own config class); YAML files and
``--set key=value`` only override them. :mod:`rankwise.recipes.config` assembles them with the
registered sections (``task``, ``method``, ``optim``, ``compress``) into a ``RunConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union

from rankwise.configs import CHOICE, Choice, bounded, chosen
from rankwise.data.tokenizer import TokenizerTrainConfig
from rankwise.engine.schedules import NoScheduleConfig, UniformOrderConfig

MAX_TOKENS = 2**24  # data.max_length's ceiling: beyond any model's positions, within tokenizers' range


@dataclass
class ModelConfig:
    """Which model to adapt.

    Attributes:
        path: ``demo`` (the packaged MiniLM), a local Hugging Face model folder, or one of the
            tiny in-code models ``tiny-bert``, ``tiny-gpt2``, ``tiny-llama`` (for tests).
        num_labels: Number of classes; ``None`` infers it from the data.
        dtype: Storage dtype of the frozen base: ``float32``, ``bfloat16`` or ``float16``
            (trainable weights are float32 whatever this says).
        quantize: Load the base quantized by bitsandbytes through transformers'
            ``BitsAndBytesConfig``: ``nf4`` / ``fp4`` (4-bit, QLoRA) or ``int8``; ``null`` = no.
        double_quant: Quantize the 4-bit block scales too (QLoRA's double quantization).
        add_tokens: New tokens given to the tokenizer (``tokenizer.add_tokens``); the
            embedding (and an untied output head) grows by their rows, each initialised to the
            mean of the existing rows (:mod:`rankwise.recipes.tokens`).
        add_special_tokens: New special tokens (never split, e.g. a chat template's
            ``<|im_start|>``), added and initialised the same way.
        init: Where the weights start: ``pretrained`` (the folder's weights), ``random`` (a
            fresh initialisation from the folder's ``config.json``, seeded by ``train.seed``:
            pretraining from scratch, ``method: full``), or ``auto`` (``random`` when the folder
            holds a ``config.json`` and no weights, else ``pretrained``).
        train_tokenizer: Learn a tokenizer from the run's training text before the model is
            built (:class:`~rankwise.data.tokenizer.TokenizerTrainConfig`; saved in the run
            folder's ``tokenizer/``, reused on ``--resume``); the model's vocabulary is sized to
            it. Needs ``init: random`` (or a config-only folder). ``null``: the folder's tokenizer.
        adapter: Start from an existing adapter instead of a fresh one: a PEFT LoRA folder, a
            rankwise adapter folder or a finished train run (:mod:`rankwise.recipes.start`). Its
            method, ranks and weights continue (the ``method`` section becomes the adapter's);
            DPO's / GRPO's reference is then the starting model (``task.reference``).
    """

    path: str = "demo"
    num_labels: Union[int, None] = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quantize: Union[Literal["nf4", "fp4", "int8"], None] = None
    double_quant: bool = True
    add_tokens: list[str] = field(default_factory=list)
    add_special_tokens: list[str] = field(default_factory=list)
    init: Literal["auto", "pretrained", "random"] = "auto"
    train_tokenizer: Union[TokenizerTrainConfig, None] = None
    adapter: Union[str, None] = None

    def problems(self) -> list[str]:
        """Return value errors."""
        for key in ("add_tokens", "add_special_tokens"):
            if not all(getattr(self, key)):
                return [f"{key}: got an empty token string; list the new tokens, e.g. ['<|im_end|>']"]
        if self.train_tokenizer is not None and self.init == "pretrained":
            return ["train_tokenizer gives the model a new vocabulary, which pretrained weights "
                    "do not know; set model.init: random (or remove train_tokenizer)"]
        return []


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes examples (:mod:`rankwise.data`).

    Attributes:
        source: ``demo`` (stdlib docstring topics), ``stdlib-functions`` (prompt = a stdlib
            function's docstring, completion = its ``def`` line), ``stdlib-source`` (one text
            per standard-library module, whole modules held out: a pretraining corpus,
            :mod:`rankwise.data.corpus`), a ``.jsonl``/``.csv``/``.parquet``
            file, or a folder written by ``datasets.Dataset.save_to_disk`` (all read through
            ``datasets``: memory-mapped Arrow, tokenization cached).
        format: ``text`` (every token trains; classification uses it), ``prompt-completion``
            (loss on the completion + EOS only) or ``chat`` (a list of ``{role, content}``
            messages through the chat template; loss on assistant turns only). Causal LM.
            Presets of those (:mod:`rankwise.data.presets`; ``task.name: causal-lm``): ``alpaca``
            (``{instruction, input, output}`` records through the Alpaca prompt, as
            ``prompt-completion``) and ``sharegpt`` (``{conversations: [{from, value}]}``, as
            ``chat``).
        text_field: Column/key holding the text.
        label_field: Column/key holding the label (classification).
        prompt_field: Column/key of the prompt (``prompt-completion``).
        completion_field: Column/key of the completion (``prompt-completion``).
        messages_field: Column/key of the messages (``chat``).
        chosen_field: Column/key of the preferred completion (``task.name: dpo``).
        rejected_field: Column/key of the dispreferred completion (``task.name: dpo``).
        train_on_prompt: Prompt tokens are loss targets too (``prompt-completion``).
        chat_template: A Jinja chat template (text, or a file path) used instead of the
            tokenizer's own; needed when the tokenizer has none.
        packing: Pack several examples into each ``max_length`` block for training (causal
            LM); they never attend to each other and their positions restart.
        max_length: Tokens per example. Text is cut from the right (unless ``split_long``); a
            prompt is cut from the left, and an example whose completion alone is longer is
            dropped and counted.
        split_long: ``text`` format, causal LM: a text longer than ``max_length`` becomes
            several consecutive examples (``BOS + text + EOS`` in windows of ``max_length``)
            instead of being cut, so pretraining sees all of every document.
        eval_source: A separate evaluation file; else a held-out fraction of ``source``.
        eval_fraction: Held-out fraction, chosen by a hash of each record (deterministic).
        limit: Use at most this many training records (``None`` = all).
        cache_dir: Where ``datasets`` keeps Arrow conversions (``None``: its default cache).
        label_noise: Share of *training* class labels flipped to another class, in [0, 1)
            (robustness experiments; evaluation labels stay clean; :mod:`rankwise.data.noise`).
        label_noise_seed: Seeds which labels flip (independent of ``train.seed``).
        holdout: What the run evaluates on: ``eval`` (the evaluation split) or ``validation``
            (a deterministic ``validation_fraction`` of the *training* records, held out of
            training; learning-rate sweeps choose on it so the evaluation split stays unseen).
        validation_fraction: Share of the training records held out with ``holdout: validation``.
        schedule: How a training step's examples are grouped into processes and micro-batches,
            a registered schedule (:mod:`rankwise.engine.schedules`): ``none`` (contiguous
            shares in draw order) or ``{name: skrull, linear: ..., bucket: ...}`` (by the cost
            ``a L + b L^2`` of each sequence: LPT over processes, padding-aware micro-batches;
            the same examples and loss per step; ``docs/skrull.md``).
        select: Which training records to keep, a registered selection rule (kind
            ``select-rule``, :mod:`rankwise.recipes.select_rules`; ``docs/select.md``):
            ``{name: less, budget: 0.1, target: ..., its keys}``, a bare name, or
            ``{from: DIR}`` (the ids an earlier ``rankwise select`` chose); ``null``: every record.
        order: Which examples each step draws, a registered order: ``uniform`` (a fresh
            permutation per epoch) or ``{name: gain-rl, ...}`` (``task.name: grpo``: prompts
            sorted by GAIN-RL's angle concentration, drawn by its Gaussian sampler;
            :class:`rankwise.tasks.grpo.config.GainRLConfig`).
        question_free: QFFT (``prompt-completion`` / ``chat``): training examples are the
            responses alone, without any question token; evaluation keeps the question
            (:mod:`rankwise.data.formats`; ``docs/preference-rl.md``).
        question_free_eos: With ``question_free``, end every response with EOS. Off by default,
            as the released ``qwen_qfft`` template adds none (stopping is left to the model).
    """

    source: str = "demo"
    format: Literal["text", "prompt-completion", "chat", "alpaca", "sharegpt"] = "text"
    text_field: str = "text"
    label_field: str = "label"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    train_on_prompt: bool = False
    chat_template: Union[str, None] = None
    packing: bool = False
    max_length: int = bounded(64, ge=2, le=MAX_TOKENS, what="tokens")
    split_long: bool = False
    eval_source: Union[str, None] = None
    eval_fraction: float = bounded(0.2, gt=0.0, lt=1.0)
    limit: Union[int, None] = bounded(None, ge=1, what="a number of records")
    cache_dir: Union[str, None] = None
    label_noise: float = bounded(0.0, ge=0.0, lt=1.0, what="a fraction")
    label_noise_seed: int = bounded(0, ge=0, le=2**32 - 1)
    holdout: Literal["eval", "validation"] = "eval"
    validation_fraction: float = bounded(0.1, gt=0.0, lt=1.0)
    schedule: Any = chosen("schedule", NoScheduleConfig)
    select: Any = field(default=None, metadata={CHOICE: Choice("select-rule", "reuse", nullable=True)})
    order: Any = chosen("order", UniformOrderConfig)
    question_free: bool = False
    question_free_eos: bool = False

    def problems(self) -> list[str]:
        """Return value errors."""
        out = []
        if self.question_free and self.format == "text":
            out.append("question_free drops the question of prompt-completion or chat records, and "
                       "plain text (data.format: text) has none; set data.format or remove question_free")
        if self.question_free_eos and not self.question_free:
            out.append("question_free_eos ends question-free responses with EOS, and question_free "
                       "is off; set question_free: true or remove question_free_eos")
        if self.question_free and self.train_on_prompt:
            out.append("question_free trains on the response alone, so train_on_prompt has no prompt "
                       "to train; set one of them false")
        if self.split_long and self.format != "text":
            out.append(f"split_long cuts plain text into windows, and data.format is {self.format!r}; "
                       "set data.format: text or remove split_long")
        if self.schedule.name == "skrull" and self.packing:
            out.append("schedule: skrull groups whole sequences by length, and packing already "
                       "makes equal blocks; set one of data.schedule: none or data.packing: false")
        return out


@dataclass
class TrainConfig:
    """The training loop.

    Attributes:
        steps: Optimizer steps.
        batch_size: Examples per step.
        eval_batch_size: Examples per evaluation forward.
        eval_every: Evaluate every N steps (0 = only at the end).
        save_every: Checkpoint every N steps (0 = only at the end).
        log_every: Write a line to ``events.jsonl`` every N steps.
        seed: Seeds model init, data order and dropout.
        warmup_fraction: Linear warm-up over this fraction of steps, then linear decay to 0.
        grad_clip: Clip the gradient norm to this value; ``null`` or 0 = off; ``auto`` = what
            the optimizer's registration asks for (1.0, or off for optimizers that set their
            own step from the gradient norm: ``ngn-m``, ``t-signsgd``). A run's ``config.yaml``
            holds the value in force (``null`` when off).
        calibration_batches: Batches given to data-driven initialisations (GoRA).
        keep_checkpoints: How many checkpoints to keep.
        early_stopping_patience: Stop after this many evaluations (``eval_every``) without a
            lower ``eval_loss`` (0 = never).
        progress: Show a progress bar.
        precision: Autocast compute: ``fp32`` (none), ``bf16`` or ``fp16`` (with a gradient
            scaler, saved in checkpoints). Trainable weights stay float32 in every mode.
        gradient_checkpointing: Recompute each transformer block's activations in the backward
            pass (non-reentrant; transformers models).
        grad_accum: Micro-batches per optimizer step; ``batch_size`` stays the examples per
            step, and the loss is normalised by the targets of the whole step.
        log_to: Experiment trackers besides ``events.jsonl`` (registry kind ``tracker``,
            :mod:`rankwise.trackers`), each a name or ``{name: ..., <option>: ...}``:
            ``tensorboard`` (``RUN_DIR/tensorboard``), ``wandb`` (an offline run in
            ``RUN_DIR/wandb`` unless ``WANDB_MODE`` / ``mode`` says), ``mlflow`` (the file store
            ``RUN_DIR/mlruns`` unless ``MLFLOW_TRACKING_URI`` / ``tracking_uri`` says). Each
            needs its package (``pip install 'rankwise[wandb]'``, ...). Held resolved: the
            trackers' config dataclasses.
        distributed: Under ``torchrun`` with several processes: ``ddp`` (every process holds
            the model; gradients are summed) or ``fsdp`` (FSDP2 ``fully_shard``: parameters
            sharded across processes). ``batch_size`` is then the global batch.
        distributed_timeout_s: Seconds a process waits for the others in a collective before
            it gives up (a dead or stuck process ends the run instead of hanging it).
        distributed_step_timeout_s: The collective timeout from the end of the first
            optimizer step on, once start-up (loading, the first collectives) is through:
            ``null`` keeps ``distributed_timeout_s`` throughout. It must still cover the longest
            wait of a step: an evaluation, or a checkpoint that rank 0 writes.
        threads: Torch CPU threads per process: ``auto`` = the CPUs this process may use
            (affinity mask, cgroup quota) shared by the run's processes on the machine
            (``rankwise.engine.threads``), or a number.
        loss_chunk_tokens: Causal LM: compute the loss from the final hidden states through
            the output head in chunks of this many target tokens, each chunk's logits
            recomputed in the backward (:mod:`rankwise.engine.chunked_loss`; same loss and
            gradients up to float rounding); DPO, KTO, ORPO, SimPO, GRPO and RLOO: their
            completion log-probs the same way (:mod:`rankwise.tasks.logprobs`); 0 = off; ``auto`` = :attr:`AUTO_CHUNK_TOKENS` when
            the model's vocabulary has at least :attr:`AUTO_CHUNK_VOCAB` entries, else off.
            Why 32,000 and 512: the unchunked loss keeps about four fp32 copies of the
            ``(tokens x vocab)`` logits alive (logits, log-softmax, both gradients), 16 V bytes
            a token: at V = 32,000 that is 512 KB a token, more than a 7B Llama's checkpointed
            activations (~ 32 layers x 4096 x 2 bytes = 256 KB) and the largest item of a LoRA
            step; from Llama-2's 32,000 to Qwen's 152k and Gemma's 256k it only grows. The cost
            is one more head forward per target token (``2 H V`` flops: 0.6 % of Llama-2-7B's
            ``6 N`` flops a token, 2 % of Llama-3-8B's). The tiny test models (MiniLM's 30,522-token
            vocabulary) stay on the unchunked path. 512 tokens keep one chunk's fp32 logits at
            256 MiB for a 128k vocabulary while the ``512 x H x V`` matmul still runs at full
            speed.
        offload_activations: Keep the tensors the forward saves for backward in pinned CPU
            memory until the backward needs them (copies on a side CUDA stream; parameters and
            tensors under 1 KiB stay; ``docs/offload.md``). No effect on a CPU device, where
            activations already live in CPU memory (``rankwise train`` says so).
        compile: ``torch.compile`` the model's blocks (each layer of its ``nn.ModuleList``s,
            ``rankwise.engine.compile``); a method dynamo cannot trace is refused before
            training. The first steps pay the compilation, one per length bucket
            (``compile_buckets``). ``auto``: the first :attr:`AUTO_COMPILE_STEPS` steps run
            eager and are timed; compilation is turned on only when the remaining steps x the
            expected saving per step (:attr:`AUTO_COMPILE_SAVING` of the eager step) exceed the
            expected compile time (:attr:`AUTO_COMPILE_GRAPH_S` seconds per bucket and block
            kind); one console line says what it chose, with the numbers. A method it cannot
            trace, ``gradient_checkpointing`` or a federated client: eager, said on the
            console. Not the default: the choice rests on timings, so the same config may
            compile on one machine and not on another (the numbers then differ at float
            rounding), and a resumed run decides again from its own first steps.
        compile_buckets: Under ``compile``, every training and evaluation batch is right-padded
            (masked: the same loss; ``rankwise.engine.buckets``) to the smallest of these
            lengths that holds it, so a run compiles one graph per bucket used, not one per
            new length. ``pow2`` (default): 64, 128, 256, ... below ``data.max_length``, then
            ``data.max_length`` -- ``log2(max_length / 64) + 1`` graphs at most (5 at 1,024,
            7 at 4,096) for at most 2x the tokens of a batch (a batch's longest row sets its
            length anyway); chosen over multiples of 64 (less padding, but ``max_length / 64``
            graphs: 16 at 1,024, each ~18 s on CPU) because on CPU a compilation costs
            hundreds of steps. An integer ``k``: the multiples of ``k`` (then
            ``max_length``); a list: those lengths (those >= 1); ``0``: no padding (dynamic shapes: the
            compiler may recompile as new lengths come). Packed blocks all have
            ``max_length`` tokens: one graph.
        fused_lora: ``auto``: LoRA-wrapped linear layers (LoRA, rsLoRA, GoRA ranks; one active
            adapter, no dropout in training, not DoRA) run one autograd node with a hand-written
            backward that saves less (``rankwise.adapters.lora.fused``, ``docs/fused-lora.md``),
            and the layers that read one input (q/k/v, gate/up; found by one probe forward
            before the first step, ``rankwise.core.shared_inputs``) share one
            ``x [A_1; ...; A_k]`` product; same losses and gradients. ``unshared``: the fused
            node, one product per layer. ``off`` (or ``false``): the plain path.
        neftune_noise_alpha: NEFTune (Jain et al. 2024): uniform noise of scale
            ``alpha / sqrt(L d)`` on the input embeddings of the training forwards only, ``L``
            each example's real tokens (:mod:`rankwise.engine.neftune`; the paper uses 5-15);
            ``null``: off.
    """

    AUTO_CHUNK_VOCAB: ClassVar[int] = 32_000
    AUTO_CHUNK_TOKENS: ClassVar[int] = 512
    AUTO_COMPILE_STEPS: ClassVar[int] = 3  # eager steps before the choice (the first untimed)
    AUTO_COMPILE_SAVING: ClassVar[float] = 0.17  # 1 - 1/1.21: a compiled block step, CPU inductor
    AUTO_COMPILE_GRAPH_S: ClassVar[float] = 20.0  # one bucket's forward + backward, CPU inductor

    steps: int = bounded(200, ge=1)
    batch_size: int = bounded(32, ge=1)
    eval_batch_size: int = bounded(64, ge=1)
    eval_every: int = bounded(0, ge=0)
    save_every: int = bounded(50, ge=0)
    log_every: int = bounded(5, ge=0)
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    warmup_fraction: float = 0.06
    grad_clip: Union[float, None, Literal["auto"]] = bounded("auto", ge=0, what="a norm", hint=(
        "(null or 0: off; auto: the optimizer's choice)"))
    calibration_batches: int = bounded(8, ge=0)
    keep_checkpoints: int = 2
    early_stopping_patience: int = bounded(0, ge=0)
    progress: bool = True
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    gradient_checkpointing: bool = False
    grad_accum: int = bounded(1, ge=1)
    log_to: list[Union[str, dict]] = field(default_factory=list)
    distributed: Literal["ddp", "fsdp"] = "ddp"
    distributed_timeout_s: float = bounded(600.0, gt=0, what="seconds")
    distributed_step_timeout_s: Union[float, None] = bounded(None, gt=0, what="seconds")
    threads: Union[Literal["auto"], int] = bounded("auto", ge=1, le=4096, hint="or auto")
    offload_activations: bool = False
    compile: Union[bool, Literal["auto"]] = False
    compile_buckets: Union[Literal["pow2"], int, list[int]] = bounded("pow2", ge=0, what="tokens",
                                                                      hint="(0: no buckets)")
    fused_lora: Union[Literal["auto", "unshared", "off"], bool] = "auto"  # YAML reads a bare off as false
    loss_chunk_tokens: Union[Literal["auto"], int] = bounded("auto", ge=0, what="tokens per chunk",
                                                             hint="or auto (0: off)")
    neftune_noise_alpha: Union[float, None] = bounded(None, gt=0, what="alpha", hint="(the paper uses 5 to 15; null: no noise)")

    def __post_init__(self) -> None:
        from rankwise.trackers import resolve
        self.log_to, self._log_to_problems = resolve(self.log_to)  # names -> typed configs

    def loss_chunk_for(self, vocab: int | None) -> int:
        """Target tokens per loss chunk for a model of ``vocab`` entries (0 = unchunked)."""
        if self.loss_chunk_tokens != "auto":
            return int(self.loss_chunk_tokens)
        return self.AUTO_CHUNK_TOKENS if (vocab or 0) >= self.AUTO_CHUNK_VOCAB else 0

    def problems(self) -> list[str]:
        """Return value errors."""
        out = list(getattr(self, "_log_to_problems", []))
        if self.grad_accum >= 1 and self.batch_size >= 1 and self.batch_size % self.grad_accum:
            out.append(f"grad_accum: got {self.grad_accum}, which does not divide batch_size "
                       f"{self.batch_size} (examples per optimizer step); choose a divisor such as "
                       f"{max(d for d in range(1, self.grad_accum + 1) if self.batch_size % d == 0)}")
        if self.compile is True and self.gradient_checkpointing:
            out.append("compile: torch.compile with gradient_checkpointing is not supported yet; "
                       "set train.compile: false or train.gradient_checkpointing: false")
        return out


@dataclass
class EvalConfig:
    """What each evaluation writes besides the metrics.

    Attributes:
        samples: Greedy completions of the first N evaluation prompts, written to
            ``samples.jsonl`` at every evaluation (causal LM; 0 = none).
        max_new_tokens: Tokens generated per sample.
    """

    samples: int = bounded(0, ge=0)
    max_new_tokens: int = bounded(32, ge=1)



__all__ = ["DataConfig", "EvalConfig", "MAX_TOKENS", "ModelConfig", "TrainConfig"]
