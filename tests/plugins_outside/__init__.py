"""A third-party plugin package, kept outside specloop, for the custom-component tests."""
