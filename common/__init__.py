"""What the trainer and the pipeline steps share: the errors a step fails with, and the S3 client.

It sits below both and imports neither, so the trainer image installs it without the pipeline's code (kfp,
kubernetes); tests/test_docker.py checks the layering.
"""
