//! Every shape of training function `#[accelerate]` accepts, each in its own module, in one
//! program (one link of libtorch): `shapes list` names them; `shapes NAME BATCH EPOCHS DIR`
//! trains one and writes this process's final weights to `DIR/rank{R}.safetensors`;
//! `shapes forgotten CASE` runs the explicit API with a `prepare_*` call left out (forgotten.rs).
//! `tests/ui.rs` runs each on 1 process and on 2 (through `accel launch`) and checks that
//! every rank ends with the weights of the 1-process run with twice the batch.

mod common;
mod forgotten;

use tch::Tensor;

type Shape = fn(&common::Data) -> anyhow::Result<Vec<(String, Tensor)>>;

macro_rules! shapes {
    ($($shape:ident),* $(,)?) => {
        $(mod $shape;)*
        const SHAPES: &[(&str, Shape)] = &[$((stringify!($shape), $shape::run)),*];
    };
}

shapes!(
    amsgrad_groups_and_setters,
    anyhow_result_varstore_by_ref,
    backward_inside_if,
    batch_norm_buffers_agree,
    blocks_labels_and_values,
    borrowed_split_zip,
    closure_called_in_place,
    backward_step_clip,
    backward_step_mut_varstore,
    closure_optimizer_with_model_key,
    enumerate_skip_and_break,
    gan_two_models,
    helper_optimizer_with_model_key,
    helper_sets_the_schedule,
    helper_steps_the_optimizer,
    index_loop_enumerated_with_a_schedule,
    index_range_loop,
    iterator_argument_while_let,
    iterator_shuffled_before_the_loop,
    loop_let_else,
    manual_data,
    match_arm_with_varstore_save_and_load,
    method_called_once_per_epoch,
    method_with_varstore_field,
    nested_loops_inline_loss_accel_optimizer,
    optimizer_argument_with_model_key,
    optimizer_from_a_helper_one_model,
    optimizer_in_a_field_with_model_key,
    owned_varstore_box_error_while_let,
    pretrain_then_fine_tune,
    reborrowed_varstore,
    sync_batchnorm,
    teacher_and_student,
    tch_error_mut_varstore,
    try_inside_the_loop,
    unit_return_backward_step,
    vec_iter_enumerate_accumulate_by_hand,
    zero1_sgd_nesterov,
    zero2_clip_and_set_lr,
    zero3_evaluates_between_epochs,
    zero3_optimizer_in_backward_sgd,
    zero3_reads_its_weights_after_the_loop,
    zero3_writes_its_weights_between_epochs,
    wgan_critic_steps,
    zip_of_two_iterators,
);

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [list] = args.as_slice() {
        anyhow::ensure!(list == "list", "usage: shapes list | shapes NAME BATCH EPOCHS DIR");
        for (name, _) in SHAPES {
            println!("{name}");
        }
        return Ok(());
    }
    if let [forgotten, case] = args.as_slice() {
        anyhow::ensure!(forgotten == "forgotten", "usage: shapes forgotten CASE");
        let dir = std::env::temp_dir();
        return forgotten::run(case, &common::Data { batch_size: 8, epochs: 2, dir });
    }
    let [name, batch, epochs, dir] = args.as_slice() else {
        anyhow::bail!("usage: shapes list | shapes NAME BATCH EPOCHS DIR");
    };
    let (_, shape) = SHAPES
        .iter()
        .find(|(n, _)| n == name)
        .ok_or_else(|| anyhow::anyhow!("no shape named {name}"))?;
    tch::manual_seed(0);
    std::fs::create_dir_all(dir)?;
    let data =
        common::Data { batch_size: batch.parse()?, epochs: epochs.parse()?, dir: dir.into() };
    let weights = shape(&data)?;
    let rank = accel_core::topology::Topology::from_env()?.rank;
    Tensor::write_safetensors(&weights, format!("{dir}/rank{rank}.safetensors"))?;
    Ok(())
}
