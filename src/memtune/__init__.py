"""memtune: LoRA / QLoRA fine-tuning of Qwen2.5-class models that fits on 24 GB cards."""

from memtune import quiet

# Every memtune process (the job, each rank, the tools) imports this package before any library
# that prints known noise: the filters are in place before that library's first message.
quiet.install()
