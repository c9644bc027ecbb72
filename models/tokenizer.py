"""The presets' byte-level tokenizer and the one chat format shared by training and serving.

Every byte is a token, so any text round-trips and no merges need training. Special tokens
frame chat turns; the trainer and the serving engine both encode through this module, so a
trained adapter sees at serving time exactly the token layout it was trained on.
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, END]
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
# Other names for a turn: OpenAI's chat API now calls the system turn "developer", so a client written for it sends
# those; they open the system turn, in training data as in requests.
ROLE_ALIASES = {"developer": "system"}
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

CHAT_TEMPLATE = (
    "{% set aliases = " + repr(ROLE_ALIASES) + " %}"
    "{{ '<bos>' }}{% for m in messages %}"
    "{{ '<|' + aliases.get(m['role'], m['role']) + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def chat_role(role: object) -> str:
    """The turn a message's role opens (an alias read as the role it names); ValueError naming the roles known."""
    turn = ROLE_ALIASES.get(role, role) if isinstance(role, str) else None
    if turn not in ROLE_TOKENS:
        known = ", ".join(sorted([*ROLE_TOKENS, *ROLE_ALIASES]))
        raise ValueError(f"role must be one of {known}, got {role!r:.40}")  # a role's text is the client's: cut short
    return turn


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: special tokens first, then one token per byte."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(byte_chars)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, model_max_length=1 << 20
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def stop_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Tokens that end a generated turn."""
    return [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(END)]


def _text_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def encode_chat(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict], add_generation_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """Token ids and a loss mask (1 on assistant content and its end token) for a chat."""
    ids = [tokenizer.convert_tokens_to_ids(BOS)]
    mask = [0]
    end_id = tokenizer.convert_tokens_to_ids(END)
    for i, message in enumerate(messages):
        content = message.get("content")
        try:
            role = chat_role(message.get("role"))
        except ValueError as e:
            raise ValueError(f"message {i}: {e}") from None
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be a string")
        body = _text_ids(tokenizer, content) + [end_id]
        learn = 1 if role == "assistant" else 0
        ids += [tokenizer.convert_tokens_to_ids(ROLE_TOKENS[role])] + body
        mask += [0] + [learn] * len(body)
    if add_generation_prompt:
        ids.append(tokenizer.convert_tokens_to_ids(ASSISTANT))
        mask.append(0)
    return ids, mask


def encode_prompt_completion(
    tokenizer: PreTrainedTokenizerFast, prompt: str, completion: str | None = None
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask for raw text: `<bos> prompt completion <eos>`, loss on the completion."""
    ids = [tokenizer.convert_tokens_to_ids(BOS)] + _text_ids(tokenizer, prompt)
    mask = [0] * len(ids)
    if completion is not None:
        body = _text_ids(tokenizer, completion) + [tokenizer.convert_tokens_to_ids(EOS)]
        ids += body
        mask += [1] * len(body)
    return ids, mask
