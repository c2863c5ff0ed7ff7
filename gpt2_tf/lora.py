"""LoRA adapters (Hu et al.) on the original conv1d products, read and written in PEFT's format.

An adapter adds x·A·B·(alpha/rank) to a conv1d's x·w + b, on the checkpoint's own [nx, nf] layout:
A [nx, rank] starts as PEFT starts lora_A (Kaiming-uniform, a = sqrt(5): uniform in ±1/sqrt(nx)) and
B [rank, nf] at zero, so an adapted model starts equal to its base. On disk it is PEFT's folder for
transformers' GPT-2 (whose Conv1D keeps the same [nx, nf] layout, hence fan_in_fan_out):

    adapter_config.json        peft_type LORA, r, lora_alpha, target_modules, fan_in_fan_out, ...
    adapter_model.safetensors  base_model.model.transformer.h.N.<module>.lora_A.weight [rank, nx] (A transposed)
                               base_model.model.transformer.h.N.<module>.lora_B.weight [nf, rank] (B transposed)

attach() puts trainable adapters on a model (fine-tuning), apply() folds a saved adapter into a model's
weights (w + A·B·scale, what loading and merging do), merge() folds attached ones in and removes them.
"""

from __future__ import annotations

import collections.abc
import contextlib
import errno
import json
import math
import os
import re
import shutil
from typing import Optional

import numpy as np
import tensorflow as tf

from .hparams import HParams
from .train_config import LORA_TARGETS as TARGETS, check_lora_options, check_targets
from .validate import GPT2Error, first_line

CONFIG, WEIGHTS = 'adapter_config.json', 'adapter_model.safetensors'
PREFIX = 'base_model.model.transformer.'
UNSUPPORTED = {'use_dora': False, 'bias': 'none', 'lora_bias': False, 'modules_to_save': None,
               'rank_pattern': {}, 'alpha_pattern': {}, 'layers_to_transform': None, 'layers_pattern': None,
               'exclude_modules': None, 'trainable_token_indices': None, 'layer_replication': None,
               'alora_invocation_tokens': None, 'velora_config': None, 'use_qalora': False,
               'monteclora_config': None, 'target_parameters': None, 'use_bdlora': None, 'arrow_config': None,
               'kasa_config': None, 'megatron_config': None}  # PEFT's options that change the math, not done here
PLAIN_INIT = (True, False, 'gaussian', 'orthogonal', 'eva')  # init_lora_weights that start from the base as it
# is (they only draw A and B); PiSSA, OLoRA, CorDA and LoftQ change the base weights themselves (PEFT saves the
# adapter against that changed base)
MERGE = 'merge it with PEFT (merge_and_unload, save_pretrained) and load the merged model'
BIN = 'adapter_model.bin'  # PEFT's PyTorch file (save_pretrained(safe_serialization=False))
OUTSIDE_BLOCKS = re.compile(r'base_model\.model\.(lm_head|transformer\.wte|transformer\.wpe)\.')  # PEFT's keys of
# LoRA on the head (tied to wte) or the embeddings


class AdapterError(GPT2Error):
    """An adapter folder that cannot be read, or does not fit the base model."""


def module_name(target: str) -> str:
    """A --lora_targets entry -> the block's module, as PEFT names it: c_attn -> attn.c_attn."""
    return 'attn.c_attn' if target == 'c_attn' else target


def convs(model, targets) -> dict:
    """{'h.N.attn.c_attn': the Conv1D} for every block and target, in block order."""
    found = {}
    for n, block in enumerate(model.h):
        for target in check_targets(targets):
            owner, name = module_name(target).split('.')
            found[f'h.{n}.{owner}.{name}'] = getattr(getattr(block, owner), name)
    return found


class Counter:
    """The dropout's seed: the updates applied, and the part of the step being traced (a micro-batch on a
    replica, set by `part`); a plain object, so no module lists it among the weights."""

    def __init__(self):
        self.value = tf.Variable(0, dtype=tf.int64, trainable=False, name='lora_counter')
        self.part = 0  # an int or a traced int32 scalar


@contextlib.contextmanager
def part(adapters: dict, index):
    """The masks drawn inside (forward and recomputed backward) are those of part `index` of the step: each
    micro-batch of an accumulated step and each replica draws its own."""
    if not adapters:
        yield
        return
    counter = next(iter(adapters.values())).counter  # attach's one, shared by every adapter
    before, counter.part = counter.part, index
    try:
        yield
    finally:
        counter.part = before


@contextlib.contextmanager
def training(adapters: dict):
    """Dropout on while the Trainer's step runs (and traces)."""
    for a in adapters.values():
        a.training = True
    try:
        yield
    finally:
        for a in adapters.values():
            a.training = False


class Adapter(tf.Module):
    """x [rows, nx] -> dropout(x)·A·B·scale [rows, nf]. Dropout only while `training` (set by the Trainer);
    its mask is stateless, seeded by the step, the part of the step and the adapter's index, so a recomputed
    block draws it again."""

    def __init__(self, nx: int, nf: int, scope: str, *, rank: int, alpha: float, dropout: float = 0.0,
                 index: int = 0, rng: Optional[np.random.Generator] = None):
        super().__init__(name=scope)
        bound = 1 / np.sqrt(nx)  # kaiming_uniform_(a=sqrt(5)) on lora_A.weight [rank, nx]: fan_in nx
        rng = rng or np.random.default_rng()
        with self.name_scope:
            self.A = tf.Variable(rng.uniform(-bound, bound, (nx, rank)).astype(np.float32), name='A')
            self.B = tf.Variable(tf.zeros([rank, nf]), name='B')
        self.scale = alpha / rank
        self.dropout, self.index = dropout, index
        self.training = False  # the Trainer sets it while its step traces
        self.counter = None  # a Counter (untracked: not a weight), the dropout's seed

    def __call__(self, x):  # [rows, nx] -> [rows, nf]
        if self.training and self.dropout:
            seed = tf.stack([self.counter.value, tf.constant(self.index, tf.int64)])
            seed = tf.random.experimental.stateless_fold_in(seed, self.counter.part)
            keep = tf.random.stateless_uniform(tf.shape(x), seed) >= self.dropout
            x = tf.where(keep, x / (1 - self.dropout), tf.zeros_like(x))
        return tf.matmul(tf.matmul(x, self.A), self.B) * self.scale

    def delta(self) -> np.ndarray:  # -> A·B·scale [nx, nf]: what merging adds to the product's w
        return delta(self.A.numpy(), self.B.numpy(), self.scale)


def attach(model, *, rank: int, alpha: Optional[float] = None, targets='c_attn', dropout: float = 0.0,
           seed: Optional[int] = None) -> dict:
    """Trainable adapters on the model's target products: {'h.N.attn.c_attn': Adapter}. alpha defaults to
    2·rank. The adapters' variables are created where the model's are (its device, its strategy)."""
    check_options(rank=rank, alpha=alpha, targets=targets, dropout=dropout)
    alpha = 2 * rank if alpha is None else alpha
    rng = np.random.default_rng(seed)
    adapters = {}
    scope = model.strategy.scope() if getattr(model, 'strategy', None) else contextlib.nullcontext()
    with model.on_device(), scope:
        counter = Counter()
        for index, (name, conv) in enumerate(convs(model, targets).items()):
            nx, nf = conv.w.shape[-2], conv.w.shape[-1]
            with conv.name_scope:
                conv.adapter = adapters[name] = Adapter(nx, nf, 'lora', rank=rank, alpha=alpha, dropout=dropout,
                                                        index=index, rng=rng)
            conv.adapter.counter = counter
    _retrace(model)
    return adapters


def safetensors():
    """The safetensors package, which PEFT's adapter files need; without it, a one-line refusal naming the extra."""
    try:
        import safetensors
        import safetensors.numpy  # noqa: F401
    except ImportError:
        raise GPT2Error("LoRA adapters are PEFT's safetensors files, which need the safetensors package: "
                        "pip install -e '.[hf]'") from None
    return safetensors


def check_options(*, rank, alpha, targets, dropout) -> None:
    """attach's options, by the command line's rule (train_config.check_lora_options): the Trainer, built without
    a config, would otherwise train at scale 0, save an alpha that loading refuses, or call a dropout of 1 a
    divergence."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:  # 0 is the command line's 'off'
        raise GPT2Error(f'lora_rank must be an integer >= 1 to attach adapters, got {rank!r}')
    check_lora_options(rank, alpha, targets, dropout)
    safetensors()  # before any step: a run's saves write them


def _retrace(model) -> None:
    """Fresh compiled calls for a Model whose products changed: its traces hold the products they saw, and
    compiled.py's shared functions take the model's variables from a list it keeps per model."""
    from . import compiled

    compiled.forget(model)
    for attr in ('_forward', '_forward_past'):
        fn = getattr(model, attr, None)
        if fn is not None:
            setattr(model, attr, tf.function(fn.python_function, input_signature=fn.input_signature,
                                             jit_compile=getattr(fn, '_jit_compile', None), autograph=False))


def detach(model) -> None:
    for conv in convs(model, TARGETS).values():
        conv.adapter = None
    _retrace(model)


def delta(a: np.ndarray, b: np.ndarray, scale) -> np.ndarray:
    """A [nx, r] · B [r, nf] · scale in float32: the one formula of every merge (attached adapters saved, an
    adapter folded in at load), so that they give the same bits; int8's per-column scales would turn an ulp
    between two formulas (a fused multiply-add or not) into a different rounding of the whole column."""
    return (np.asarray(a, np.float32) @ np.asarray(b, np.float32)) * np.float32(scale)


def deltas(adapters: dict) -> dict:
    """{'h.N.attn.c_attn': A·B·scale [nx, nf]} of attached adapters."""
    return {name: a.delta() for name, a in adapters.items()}


def _fold(model, deltas_: dict) -> None:
    if model.dtype == 'int8':  # w + delta of the int8 values would drop their scales
        raise AdapterError('adapters fold into float weights, not int8 ones: load the base with load_model(base, '
                           'adapter=RUN, dtype="int8"), which merges in float32, then quantizes')
    found = convs(model, TARGETS)
    for name, delta in deltas_.items():
        conv = found[name]
        merged = tf.cast(conv.w, tf.float32) + tf.constant(delta[None], tf.float32)  # [1, nx, nf]
        conv.w.assign(tf.cast(merged, conv.w.dtype))


def merge(model, adapters: dict) -> None:
    """Folds attached adapters into the weights (w + A·B·scale) and removes them: the model is then a plain
    model with the adapted logits, which save_checkpoint and save_hf write in their formats."""
    _fold(model, deltas(adapters))
    detach(model)


# --- PEFT's folder ---------------------------------------------------------------------------------

def peft_config(*, rank: int, alpha: float, targets, dropout: float = 0.0, base: str = '') -> dict:
    return {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': rank, 'lora_alpha': alpha,
            'target_modules': [module_name(t) for t in check_targets(targets)], 'lora_dropout': dropout,
            'fan_in_fan_out': True, 'bias': 'none', 'base_model_name_or_path': base, 'inference_mode': True,
            'init_lora_weights': True, 'modules_to_save': None}


def peft_tensors(adapters: dict) -> dict:
    """{PEFT key: array} in PEFT's layout: lora_A.weight [rank, nx], lora_B.weight [nf, rank]."""
    tensors = {}
    for name, a in adapters.items():
        tensors[f'{PREFIX}{name}.lora_A.weight'] = np.ascontiguousarray(a.A.numpy().T)
        tensors[f'{PREFIX}{name}.lora_B.weight'] = np.ascontiguousarray(a.B.numpy().T)
    return tensors


def _unset(value) -> bool:
    """None, False or empty: an option left off (0 is a value: layer 0)."""
    return value is None or value is False or value == {} or value == []


def is_adapter_folder(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), CONFIG))


def save(folder: str, adapters: dict, config: dict, *, step: Optional[int] = None,
         dtype: Optional[str] = None) -> None:
    """adapter_config.json and adapter_model.safetensors (each whole or absent: written aside, then renamed);
    the step and the dtype of the base weights trained over, when given, go in the safetensors metadata, which
    is what a resumed run trusts."""
    save_file = safetensors().numpy.save_file

    os.makedirs(folder, exist_ok=True)
    weights, temporary = os.path.join(folder, WEIGHTS), os.path.join(folder, f'{WEIGHTS}.tmp-{os.getpid()}')
    metadata = {'format': 'pt', 'lora_alpha': str(config.get('lora_alpha'))}  # checked against the config read
    if step is not None:
        metadata['step'] = str(step)
    if dtype is not None:
        metadata['dtype'] = dtype
    text = json.dumps(config, indent=2) + '\n'
    settings = os.path.join(folder, f'{CONFIG}.tmp-{os.getpid()}')
    with open(settings, 'w', encoding='utf-8') as f:
        f.write(text)
    tensors = peft_tensors(adapters)
    try:
        save_file(tensors, temporary, metadata=metadata)
    except Exception as e:  # safetensors' own error type (a full disk, say), or OSError
        for path in (temporary, settings):
            if os.path.isfile(path):
                os.remove(path)
        raise OSError(getattr(e, 'errno', None) or errno.EIO, f'{weights} cannot be written ({first_line(e)})') \
            from None
    shutil.copymode(settings, temporary)  # safetensors writes through a private (0600) file
    os.replace(temporary, weights)
    os.replace(settings, os.path.join(folder, CONFIG))


def saved_step(folder: str) -> Optional[int]:
    """The step in a saved adapter's metadata (ours), without reading its tensors; None where it has none."""
    safe_open = safetensors().safe_open

    path = os.path.join(folder, WEIGHTS)
    try:
        with safe_open(path, framework='numpy') as f:
            return step_of(f.metadata() or {})
    except Exception as e:  # a missing, truncated or foreign file
        raise AdapterError(f'cannot read {path}: {first_line(e)}') from None


def step_of(metadata: dict) -> Optional[int]:
    """The step a saved adapter's metadata holds (ours); None for PEFT's, which hold none."""
    step = metadata.get('step')
    return int(step) if step and step.isdigit() else None


def read_config(folder: str) -> dict:
    path = os.path.join(folder, CONFIG)
    try:
        with open(path, encoding='utf-8') as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise AdapterError(f'cannot read {path}: {e}') from None
    if not isinstance(config, dict) or config.get('peft_type') != 'LORA':
        raise AdapterError(f'{path}: peft_type is {config.get("peft_type") if isinstance(config, dict) else None!r}; '
                           f'only LORA adapters load here')
    for key, plain in UNSUPPORTED.items():
        value = config.get(key, plain)
        if value != plain and not (_unset(plain) and _unset(value)):
            raise AdapterError(f'{path}: {key}={value!r} is not supported here (plain LoRA only: {key}={plain!r}); '
                               f'{MERGE}')
    if not isinstance(config.get('use_rslora', False), bool):
        raise AdapterError(f'{path}: use_rslora must be true or false, got {config["use_rslora"]!r}')
    init = config.get('init_lora_weights', True)
    if not any(init is plain or init == plain and isinstance(init, str) for plain in PLAIN_INIT):
        raise AdapterError(f'{path}: init_lora_weights={init!r} adapts a changed base model, not this one; {MERGE}')
    rank, alpha = config.get('r'), config.get('lora_alpha')
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:  # PEFT writes an int, and builds no other
        raise AdapterError(f'{path}: r must be an integer >= 1, got {rank!r}; write there the rank the adapter was '
                           f'trained with (the rows of its lora_A)')
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:  # json reads NaN
        raise AdapterError(f'{path}: lora_alpha must be a finite number > 0, got {alpha!r}; write there the alpha '
                           f'the adapter was trained with')
    return config


def read(folder, model) -> tuple:
    """(config, {'h.N.attn.c_attn': (A [nx, r], B [r, nf])}, the file's metadata), every tensor checked against the
    model: names, the config's rank, shapes (another model size or vocabulary), dtype, nothing left over."""
    folder = os.fspath(folder)
    config = read_config(folder)
    check_base(folder, model.hparams)
    path, rank = os.path.join(folder, WEIGHTS), config['r']
    if not os.path.exists(path) and os.path.isfile(os.path.join(folder, BIN)):
        from .tensorfiles import read_torch

        path, metadata = os.path.join(folder, BIN), {}
        tensors = read_torch(path, AdapterError)
    else:
        safe_open = safetensors().safe_open
        try:
            with safe_open(path, framework='numpy') as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
                metadata = f.metadata() or {}
        except Exception as e:  # a missing, truncated or foreign file
            raise AdapterError(f'cannot read {path}: {first_line(e)}') from None
    _check_blocks_only(tensors, path)
    targets = _targets(config, path, model.hparams.n_layer)
    found, pairs = convs(model, targets), {}
    for name, conv in found.items():
        nx, nf = conv.w.shape[-2], conv.w.shape[-1]
        a = _tensor(tensors, f'{PREFIX}{name}.lora_A.weight', (rank, nx), path)
        b = _tensor(tensors, f'{PREFIX}{name}.lora_B.weight', (nf, rank), path)
        pairs[name] = (a.T.astype(np.float32), b.T.astype(np.float32))
    left = sorted(set(tensors) - {f'{PREFIX}{n}.lora_{x}.weight' for n in found for x in 'AB'})
    if left:
        raise AdapterError(f'{path}: {left[0]} has no place in this model ({model.hparams.n_layer} layers, targets '
                           f'{", ".join(module_name(t) for t in targets)}): an adapter for another base model?')
    if _number(metadata.get('lora_alpha')) not in (None, float(config['lora_alpha'])):
        raise AdapterError(f'{path} was saved with lora_alpha {metadata["lora_alpha"]}, but {CONFIG} says '
                           f'{config["lora_alpha"]}: a save cut short between the two files; save the run again, or '
                           f'set lora_alpha {metadata["lora_alpha"]} there')
    return config, pairs, metadata


def check_base(folder: str, hparams: HParams) -> None:
    """An adapter folder that records its base's hparams.json (a run folder of ours) goes only onto a base of
    those: its shapes alone do not tell another vocabulary or head count."""
    held = os.path.join(folder, 'hparams.json')
    if os.path.isfile(held) and HParams.from_json(held) != hparams:
        raise AdapterError(f'{folder} was trained on a base of {HParams.from_json(held)}, not this model\'s '
                           f'{hparams}: load it onto the base it was trained on')


def _check_blocks_only(tensors: dict, path: str) -> None:
    """Adapters here go on the blocks' products; PEFT's on the head (lm_head, whose weight is wte's) or the
    embeddings are refused as such, not as tensors of another model."""
    outside = sorted(k for k in tensors if OUTSIDE_BLOCKS.match(k))
    if outside:
        raise AdapterError(f'{path}: {outside[0]}: LoRA on the tied head (lm_head/wte) or the embeddings is not '
                           f'supported here, only on the blocks\' conv1d products; {MERGE}')


def _number(text) -> Optional[float]:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _targets(config: dict, path: str, n_layer: int) -> tuple:
    """The products an adapter adapts, matched as PEFT matches target_modules against module names
    (transformer.h.N.attn.c_attn): a string is a regular expression of the whole name ('all-linear': every
    product); a list holds names or their last parts (c_proj: attn.c_proj and mlp.c_proj), and as in PEFT, names
    of other architectures' modules (q_proj) match nothing here as long as some name matches. Every block must be
    adapted alike: adapters on some blocks only are refused."""
    modules = config.get('target_modules')
    names = {(n, t): f'transformer.h.{n}.{module_name(t)}' for n in range(n_layer) for t in TARGETS}
    if modules == 'all-linear':
        modules = '.*'
    if isinstance(modules, str):
        try:
            matched = {key for key, name in names.items() if re.fullmatch(modules, name)}
        except re.error as e:
            raise AdapterError(f'{path}: target_modules {modules!r} is not a regular expression ({e})') from None
    elif isinstance(modules, list) and modules and all(isinstance(m, str) for m in modules):
        matched = {key for key, name in names.items() if any(name == m or name.endswith('.' + m) for m in modules)}
    else:
        raise AdapterError(f'{path}: target_modules must be a list of module names or a regular expression, '
                           f'got {modules!r}')
    targets = [t for t in TARGETS if any((n, t) in matched for n in range(n_layer))]
    partial = [module_name(t) for t in targets if not all((n, t) in matched for n in range(n_layer))]
    if not targets:
        raise AdapterError(f'{path}: target_modules {modules!r} matches no conv1d of a GPT-2 block '
                           f'({", ".join(module_name(t) for t in TARGETS)})')
    if partial:
        raise AdapterError(f'{path}: target_modules adapts {", ".join(partial)} in some blocks only; adapters here '
                           f'cover every block (merge it with PEFT and load the merged model)')
    return check_targets(targets)


def _tensor(tensors: dict, key: str, shape: tuple, path: str) -> np.ndarray:
    if key not in tensors:
        raise AdapterError(f'{path} has no {key}: an adapter for another model or other target modules')
    value = tensors[key]
    if tuple(value.shape) != shape:
        raise AdapterError(f'{path}: {key} has shape {list(value.shape)}, this base model and rank need '
                           f'{list(shape)} (another model size, or r in {CONFIG} does not match)')
    if not np.issubdtype(value.dtype, np.floating) and str(value.dtype) != 'bfloat16':  # read as float32
        raise AdapterError(f'{path}: {key} is {value.dtype}, expected floating point')
    return value


def scale_of(config: dict) -> float:
    """What A·B is scaled by: alpha / r, or alpha / sqrt(r) with rank-stabilized LoRA (PEFT's use_rslora)."""
    rank = float(config['r'])
    return float(config['lora_alpha']) / (math.sqrt(rank) if config.get('use_rslora') else rank)


class Deltas(collections.abc.Mapping):
    """{checkpoint name of a product's w: A·B·scale [1, nx, nf] float32}, each formed when it is looked up, so
    that loading holds one at a time (all four products of 1558M would be 5.9 GB at once)."""

    def __init__(self, pairs: dict, scale: np.float32):
        self.pairs, self.scale = pairs, scale  # {checkpoint name: (A [nx, r], B [r, nf])}

    def __getitem__(self, name):
        return delta(*self.pairs[name], self.scale)[None]

    def __iter__(self):
        return iter(self.pairs)

    def __len__(self):
        return len(self.pairs)


def merged_deltas(model, folder) -> Deltas:
    """The adapter in folder (ours or PEFT's), checked against the model, as Deltas: what loading adds to the
    float32 weights before rounding them."""
    config, pairs, _ = read(folder, model)
    found = convs(model, TARGETS)
    named = {found[name].w.name.split(':')[0]: pair for name, pair in pairs.items()}
    return Deltas(named, np.float32(scale_of(config)))


def apply(model, folder) -> dict:
    """Folds the adapter in folder (ours or PEFT's) into a loaded model's weights; returns its config.
    load_model(base, adapter=folder) does it as it reads the weights, so that int8 quantizes merged ones."""
    config, pairs, _ = read(folder, model)
    scale = np.float32(scale_of(config))
    _fold(model, {name: delta(a, b, scale) for name, (a, b) in pairs.items()})
    return config


def check_fits(adapters: dict, config: dict, pairs: dict, folder) -> None:
    """A saved adapter (read()) that the attached adapters can resume: the same rank, products, alpha and dropout
    (alpha scales what was trained; dropout is part of the run)."""
    path, first = os.path.join(os.fspath(folder), CONFIG), next(iter(adapters.values()))
    rank = first.A.shape[-1]
    if config['r'] != rank or set(pairs) != set(adapters):
        raise AdapterError(f'{path}: rank {config["r"]} on {config.get("target_modules")}; this run trains rank '
                           f'{rank} on {sorted(set(n.split(".", 2)[2] for n in adapters))}: resume with the same '
                           f'lora options')
    differ = []
    if scale_of(config) != first.scale:  # this run's adapters scale by alpha / rank
        rslora = ' with use_rslora' if config.get('use_rslora') else ''
        differ.append((f'lora_alpha {config["lora_alpha"]}{rslora}', f'lora_alpha {first.scale * rank:g}'))
    if _number(config.get('lora_dropout', 0.0)) != first.dropout:
        differ.append((f'lora_dropout {config.get("lora_dropout", 0.0)}', f'lora_dropout {first.dropout:g}'))
    if differ:
        raise AdapterError(f'{path}: {", ".join(d[0] for d in differ)}; this run has {", ".join(d[1] for d in differ)}: '
                           f'resume with the same lora options')


def assign(adapters: dict, pairs: dict) -> None:
    for name, (a, b) in pairs.items():
        adapters[name].A.assign(a)
        adapters[name].B.assign(b)
