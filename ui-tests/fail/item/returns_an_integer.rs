
#[accel_core::accelerate(strategy = "ddp")]
fn train() -> i32 {
    0
}

fn main() {}
