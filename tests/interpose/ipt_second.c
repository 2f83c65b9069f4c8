/* See ipt.h. */
#include "ipt.h"

int ipt_value(void)
{
    return 2;
}

int ipt_second_marker(void)
{
    return 22;
}
