"""One bot_task's AR text, as HunyuanImage-3 writes it (the family's `text_task`): which text a task may
write, what the AR prefills after it, which ids end it, and how the image row takes it back. The
engine's `ARPlanner` asks it and keeps what is the engine's (sizes, imports, whose setting an error names).

- think / recaption (the release's generate_image): the AR prefills the rewrite's AR input
  (`template.ar_prompt_pieces`, ending in the opening tag), writes until `</recaption>`, `</answer>` or
  eos (`template.ar_stop_ids`), then prefills `[<answer>] <boi> <img_size> <img_ratio_k>`. The image row
  is rebuilt with the rewrite (`template.rewrite_from_ar`), so drop_think and the system prompt's switch
  to en_recaption apply (`template.image_row_pieces`).
- image: the text follows the prompt, so on the pretrain template it extends the prompt (ditkv's
  extension); the instruct template puts fixed text after the prompt, so there it is refused.
- auto: the release generate_image's auto writes no text (its free text mode is not served).
"""

from __future__ import annotations

from .layout import image_tail_ids
from .template import REWRITE_TASKS, TemplateSettings, answer_open, ar_stop_ids, rewrite_from_ar


class TextTask:
    def __init__(self, cfg, tokenizer, template: TemplateSettings):
        self.cfg, self.tok, self.template = cfg, tokenizer, template
        self.rewrites = template.bot_task in REWRITE_TASKS  # the image row holds the AR's text
        # the AR's text right after the prompt is more prompt: the pretrain template's image task
        self.extends_prompt = template.bot_task == "image" and not template.instruct
        self._stop_ids: tuple[int, ...] | None = None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end the text besides eos (a rewrite's closing tags), kept in it; a `ConfigError`
        for a tokenizer without them."""
        if not self.rewrites:
            return ()
        if self._stop_ids is None:
            self._stop_ids = tuple(ar_stop_ids(self.tok, self.cfg.eos_token_id))
        return self._stop_ids

    def refusal(self, max_new_tokens: int, whose: str) -> tuple[bool, str] | None:
        """Why this task cannot write `max_new_tokens` tokens: (whether the task itself is at fault rather
        than the count, the fix), None: it can. `whose`: whose task it is, for the words."""
        task = self.template.bot_task
        if self.rewrites and max_new_tokens <= 0:
            return False, (f"bot_task={task!r} ({whose}) has the AR phase write the {task} text the image row "
                           "holds: set max_new_tokens > 0 (the release allows up to 8192), or set bot_task 'image'")
        if task == "auto" and max_new_tokens > 0:
            return True, (f"bot_task 'auto' ({whose}) writes no text before the image, as the release's "
                          "generate_image (its free 'auto' text mode, where the model decides whether to think "
                          "or to draw at all, is not served); set max_new_tokens 0, or bot_task 'think' / "
                          "'recaption' for the release's rewrite, or 'image' for text that extends the prompt")
        if not self.rewrites and max_new_tokens > 0 and self.template.instruct:
            return False, ("with bot_task 'image' the AR's text extends the prompt, and the instruct template "
                           "puts fixed text after the prompt (role markers, <answer>); set max_new_tokens 0, "
                           "or bot_task 'recaption'/'think' (the release's rewrite, after the assistant marker)")
        return None

    def tail_ids(self, height: int, width: int) -> list[int]:
        """What the AR prefills after its text: `<boi> <img_size> <img_ratio_k>`, after a rewrite preceded
        by the image row's `<answer>` (instruct), so that a row that agrees with the AR's tokens to the end
        takes its whole prefix."""
        tail = image_tail_ids(self.cfg, height, width)
        if self.rewrites:
            tail = [int(i) for i in self.tok.encode(answer_open(self.template))] + tail
        return tail

    def rewrite(self, generated: list[int]) -> str:
        """The image row's rewrite from the AR's text (the opening tag the AR input ends with, then the
        text through its stop token)."""
        return rewrite_from_ar(self.template, self.tok.decode(generated))

    def extended_prompt_ids(self, prompt: str, token_ids: list[int], head_len: int, tail_len: int) -> list[int]:
        """The prompt's ids and the AR's text after them, from the AR's tokens (head, text, tail): on the
        pretrain template the prompt ends the head."""
        start = head_len - len(self.tok.encode(prompt))
        return token_ids[start:len(token_ids) - tail_len]
