// A GAN's generator step once per pass over the data, after a critic loop that deals the
// batches: the generator step is outside the prepared loop.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(batches: &[Tensor]) -> anyhow::Result<()> {
    let g_vs = nn::VarStore::new(Device::Cpu);
    let c_vs = nn::VarStore::new(Device::Cpu);
    let generator = nn::linear(g_vs.root() / "g", 4, 4, Default::default());
    let critic = nn::linear(c_vs.root() / "c", 4, 1, Default::default());
    let mut opt_g = nn::Sgd::default().build(&g_vs, 0.1)?;
    let mut opt_c = nn::Sgd::default().build(&c_vs, 0.1)?;
    for _ in 0..10 {
        for real in batches {
            let fake = generator.forward(&real.cos()).detach();
            let loss = critic.forward(&fake).mean(Kind::Float) - critic.forward(real).mean(Kind::Float);
            opt_c.backward_step(&loss);
        }
        let noise = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
        let loss = -critic.forward(&generator.forward(&noise)).mean(Kind::Float);
        opt_g.backward_step(&loss);
    }
    Ok(())
}

fn main() {}
