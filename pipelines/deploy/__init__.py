"""What the platform team applies once: manifests and policies rendered from the platform's settings."""
