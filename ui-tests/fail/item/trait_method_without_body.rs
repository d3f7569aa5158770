trait Trainer {
    #[accel_core::accelerate(strategy = "ddp")]
    fn train(&self) -> anyhow::Result<()>;
}

fn main() {}
