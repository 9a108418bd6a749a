"""The target model."""
