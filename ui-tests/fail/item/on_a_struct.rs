#[accel_core::accelerate(strategy = "ddp")]
struct Model {
    width: i64,
}

fn main() {
    let _ = Model { width: 1 }.width;
}
