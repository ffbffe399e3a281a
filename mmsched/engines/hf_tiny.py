"""The tiny LLaVA shipped in configs/hf-tiny: its config, tokenizer and image processor.

``python -m mmsched.engines.hf_tiny DIR`` writes them (the files in configs/hf-tiny came
from it). Weights are not shipped: the engine seeds them. A user with real weights points
``[engine_options] model`` at their own directory instead.
"""

from __future__ import annotations

import sys

IMAGE_SIZE, PATCH = 32, 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # the CLS token is dropped ("default" strategy)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
VOCAB = 512  # the trainer's ceiling; the model's vocabulary is what training reached
CORPUS = """A photo of a cat sitting on a red chair. Describe the image in one sentence.
What colour is the square? The square is blue and the background is white.
USER: ASSISTANT: hello world, this is a tiny tokenizer for a tiny vision language model.
The quick brown fox jumps over the lazy dog 0123456789 times. How many dogs are there?
"""


def model_config(vocab: int):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       bos_token_id=1, eos_token_id=2, pad_token_id=3)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=SPECIALS.index("<image>"),
                       vision_feature_layer=-1, vision_feature_select_strategy="default",
                       image_seq_length=IMAGE_TOKENS)


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    return tok


def image_processor():
    from transformers import CLIPImageProcessorPil as CLIPImageProcessor  # Pillow: no torchvision needed

    return CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def write(directory: str) -> None:
    tok = tokenizer()
    tok.save(f"{directory}/tokenizer.json")
    model_config(tok.get_vocab_size()).save_pretrained(directory)  # every id the model emits decodes
    image_processor().save_pretrained(directory)


if __name__ == "__main__":
    write(sys.argv[1])
