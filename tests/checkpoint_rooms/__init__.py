"""Each room of the checkpoint wing (``handlers/checkpoint/``, ``engine/checkpoint_format/``) tested
on its own, in this process, with small stand-ins for what it works with: a session without a
process group, a checkpoint directory under ``tmp_path``, a bare trainer. DCP runs for real."""
