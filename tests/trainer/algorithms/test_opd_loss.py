"""On-policy distillation's per-step KL (flowgrpo.trainer.algorithms.opd_loss): the hand check of DESIGN section 11
in both forms, the gradient against autograd, several steps at once, and the refusal of the exact form on a
deterministic step."""

import pytest
import torch

from flowgrpo.trainer.algorithms.opd_loss import opd_loss, opd_step_kl


def test_hand_check_of_design_section_11():
    teacher = torch.zeros(2, 4, 3, 3)
    student = teacher + 0.02
    assert float(opd_loss(student, teacher, 0.5, "exact").loss) == pytest.approx(0.0008, rel=1e-6)
    assert float(opd_loss(student, teacher, 0.5, "ode").loss) == pytest.approx(0.0002, rel=1e-6)


def test_gradient_pulls_the_student_mean_to_the_teacher():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64)
    std = torch.tensor([0.2, 0.5, 1.5], dtype=torch.float64)
    out = opd_loss(student, teacher, std, "exact")
    out.loss.backward()
    n, numel = 3, 32
    expected = (student.detach() - teacher) / (std.view(-1, 1, 1, 1) ** 2 * numel * n)
    assert torch.allclose(student.grad, expected, rtol=1e-12)
    assert teacher.grad is None
    by_hand = ((student.detach() - teacher) ** 2).mean(dim=(1, 2, 3)) / (2 * std**2)
    assert torch.allclose(out.kl.detach(), by_hand)


def test_several_steps_at_once_equal_the_mean_of_single_steps():
    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 3, 2, 4, generator=g), torch.randn(2, 3, 2, 4, generator=g)
    per_step_std = torch.tensor([0.3, 0.6, 0.9])
    many = opd_loss(student, teacher, per_step_std, "exact", steps_dim=True)
    singles = [opd_loss(student[:, j], teacher[:, j], float(per_step_std[j])).loss for j in range(3)]
    assert many.kl.shape == (2, 3)
    assert float(many.loss) == pytest.approx(float(torch.stack(singles).mean()), rel=1e-6)
    with pytest.raises(ValueError, match="does not fit means"):
        opd_loss(student, teacher, torch.ones(4), "exact", steps_dim=True)


def test_exact_form_needs_a_stochastic_step():
    with pytest.raises(ValueError, match="opd_kl='exact' divides by the step's transition std"):
        opd_step_kl(torch.ones(2, 3), torch.zeros(2, 3), torch.tensor([0.5, 0.0]), "exact")
    assert opd_step_kl(torch.ones(2, 3), torch.zeros(2, 3), 0.0, "ode").tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="opd_kl='kl' is not valid"):
        opd_step_kl(torch.ones(2, 3), torch.zeros(2, 3), 1.0, "kl")
